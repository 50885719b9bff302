"""Agent programs in processes of their own: a fork server, one per run's program (`--program.isolation process`).

    python -m orchestrate.gateway.forkserver MODULE:FUNCTION

It imports the program and its client libraries once, then reads jobs on standard input, one JSON line per
episode, and forks a child for each: the child leads a session of its own, plays the episode with an OpenAI
client on the episode's gateway URL (a real socket) and the task's environment, sandbox and rewards reached
through the gateway's control routes (`/episodes/EP/control/...`), and posts what the program returned (or
raised) there. What it prints goes nowhere. The server answers each job with the child's pid and reports each
child's exit: a child that exits without a result (os._exit, a crash) is its episode's failure, one that
spins past its time limit is killed with its whole group by the orchestrator (orchestrate.gateway.processes),
and neither touches the run. The server ends when its standard input closes (the orchestrator has gone).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import select
import sys
from typing import Any


def _jsonable(value: Any) -> Any:
    """What a program returned, as the orchestrator reads it (agents.gateway.agent settles it)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else str(value)  # settled as a bad reward, as in a thread
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):  # a reward by role
        return {k: _jsonable(v) for k, v in value.items()}
    return repr(value)[:1000]


async def episode(program: Any, job: dict[str, Any]) -> None:
    import httpx
    import openai

    from agents.program import ProgramTask, StepResult
    from agents.sandbox import SandboxResult
    from orchestrate.gateway.agent import program_frame

    control = job["control"]
    headers = {"Authorization": f"Bearer {job['api_key']}"}
    limit = job["time_limit_s"]
    async with httpx.AsyncClient(headers=headers, timeout=limit, verify=TLS) as http:

        async def post(op: str, body: dict[str, Any]) -> dict[str, Any]:
            response = await http.post(f"{control}/{op}", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"the episode's {op} failed: {response.text[:300]}")
            return response.json()

        def post_now(op: str, body: dict[str, Any]) -> dict[str, Any]:  # from a worker thread, or in order
            response = httpx.post(f"{control}/{op}", json=body, headers=headers, timeout=limit)
            if response.status_code != 200:
                raise RuntimeError(f"the episode's {op} failed: {response.text[:300]}")
            return response.json()

        async def step(action: str) -> StepResult:
            return StepResult(**await post("step", {"action": action}))

        task = ProgramTask(
            observation=job["observation"], seed=job["seed"], info=job["info"], model=job["model"],
            base_url=job["base_url"], api_key=job["api_key"], _step=step,
            _run_python=lambda code: SandboxResult(**post_now("python", {"code": code})),
            _reward=lambda value, role: post_now("reward", {"value": value, "role": role}), roles=job["roles"],
        )  # fmt: skip
        client = openai.AsyncOpenAI(base_url=job["base_url"], api_key=job["api_key"], max_retries=0, timeout=limit,
                                    http_client=httpx.AsyncClient(timeout=limit, verify=TLS))  # fmt: skip
        try:
            report = {"ok": True, "result": _jsonable(await program(task, client)), "stepped": task.stepped}
        except BaseException as exc:  # noqa: BLE001 - sys.exit() included: the episode's failure, reported
            where = program_frame(exc, program)
            report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "where": f"{where.filename}:{where.lineno}",
                      "stepped": task.stepped}  # fmt: skip
        await post("result", report)


def child(program: Any, job: dict[str, Any], channel: int) -> None:
    """The forked child: its own session, no output, the episode, then out."""
    os.setsid()
    os.close(channel)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    code = 0
    try:
        asyncio.run(episode(program, job))
    except BaseException:  # noqa: BLE001 - the result could not be posted: the exit says so
        code = 70
    os._exit(code)


TLS: Any = True  # one TLS context for every child's clients (made once here: each new one reads the CA file)


def warm_up() -> None:
    """What every child would do first, done once here and inherited: the client libraries' lazy imports, their
    request and reply types (pydantic builds each on first use), a TLS context. A child then costs a fork."""
    import ssl

    import httpx
    import openai

    import agents.sandbox  # noqa: F401
    import orchestrate.gateway.agent  # noqa: F401

    global TLS
    TLS = ssl.create_default_context()
    reply = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "usage": None, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop", "logprobs": None}]}  # fmt: skip
    body = json.dumps(reply).encode()

    async def app(scope, receive, send):  # a canned chat completion, in this process
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def one_call() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), verify=TLS)
        client = openai.AsyncOpenAI(base_url="http://warm-up/v1", api_key="-", max_retries=0, http_client=http)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "-"}])
        await http.post("http://warm-up/control", json={})
        await http.aclose()

    asyncio.run(one_call())


def main(path: str) -> None:
    from agents.program import load_program

    program = load_program(path)
    warm_up()

    out = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the program's import-time prints never reach the job channel
    children: dict[int, str] = {}
    pending = b""
    out.write(json.dumps({"ready": True}) + "\n")
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                break  # the orchestrator has gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(program, job, out.fileno())
                children[pid] = job["id"]
                out.write(json.dumps({"id": job["id"], "pid": pid}) + "\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(json.dumps({"id": children.pop(pid), "exited": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
