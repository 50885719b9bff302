"""Run a command in a network namespace whose one way out is the gateway (agents.harness, `--program.network
gateway`): listen on 127.0.0.1:PORT inside the namespace, forward each connection to the gateway's unix socket
(a path, reachable through the file system), run the command, exit with its status.

    python gateway_forward.py PORT UNIX_PATH -- COMMAND...

Standard library only: it runs inside the sandbox with this interpreter, before anything of the harness's.
"""

from __future__ import annotations

import asyncio
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(port: int, unix_path: str, command: list[str]) -> int:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(unix_path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    server = await asyncio.start_server(connection, "127.0.0.1", port)
    async with server:
        process = await asyncio.create_subprocess_exec(*command)
        return await process.wait()


if __name__ == "__main__":
    port, path, dashes, *command = sys.argv[1:]
    if dashes != "--" or not command:
        sys.exit("usage: gateway_forward.py PORT UNIX_PATH -- COMMAND...")
    sys.exit(asyncio.run(main(int(port), path, command)))
