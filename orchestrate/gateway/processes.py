"""The orchestrator's end of the program processes (orchestrate.gateway.forkserver): start the fork server once,
hand it an episode's job, learn the child's pid and, if it comes to that, how it exited; end a child's whole
group at its time limit or when its episode is cancelled.

The fork server ends when its standard input closes: when the orchestrator closes it, or dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

START_TIMEOUT_S = 60.0


class ProgramProcessError(RuntimeError):
    """The fork server could not start (the program does not import there): one line."""


class ProgramProcesses:
    """One fork server for one program; thread-safe (episodes on any loop)."""

    def __init__(self, program: str):
        self.program = program
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pids: dict[str, concurrent.futures.Future] = {}
        self._exits: dict[str, concurrent.futures.Future] = {}
        self._ready = concurrent.futures.Future()

    def start(self) -> None:
        with self._lock:
            if self._process is not None:
                return
            self._process = subprocess.Popen([sys.executable, "-m", "orchestrate.gateway.forkserver", self.program],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
            threading.Thread(target=self._read, name="program processes", daemon=True).start()
        try:
            self._ready.result(START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise ProgramProcessError(f"the program's fork server did not start in {START_TIMEOUT_S:g} s") from None

    def _read(self) -> None:
        process = self._process
        for line in process.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set_result(True)
            elif "pid" in message:
                self._future(self._pids, message["id"]).set_result(message["pid"])
            elif "exited" in message:
                self._future(self._exits, message["id"]).set_result(message["exited"])
        error = (process.stderr.read() or b"").decode(errors="replace").strip().splitlines()
        failure = ProgramProcessError(f"the program's fork server ended: {error[-1] if error else 'no message'}")
        with self._lock:
            waiting = [*self._pids.values(), *self._exits.values(), self._ready]
        for future in waiting:
            if not future.done():
                future.set_exception(failure)

    def _future(self, table: dict[str, concurrent.futures.Future], key: str) -> concurrent.futures.Future:
        with self._lock:
            return table.setdefault(key, concurrent.futures.Future())

    async def run(self, job: dict[str, Any]) -> int:
        """Start `job` (its `id` the episode's) in a child; its pid."""
        self.start()
        with self._lock:
            self._process.stdin.write((json.dumps(job) + "\n").encode())
            self._process.stdin.flush()
        return await asyncio.wrap_future(self._future(self._pids, job["id"]))

    def exited(self, episode: str) -> asyncio.Future:
        """Resolves with the child's exit status once it has exited."""
        return asyncio.wrap_future(self._future(self._exits, episode))

    def forget(self, episode: str) -> None:
        with self._lock:
            self._pids.pop(episode, None)
            self._exits.pop(episode, None)

    @staticmethod
    def end(pid: int) -> None:
        """End a child's whole group (it leads a session of its own): SIGKILL, no grace; its episode is over."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            process.stdin.close()  # it ends at the end of its input
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
