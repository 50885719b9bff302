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


def _settle(future: concurrent.futures.Future, value: Any) -> None:
    """A result (or an exception) for a future nobody may be waiting for any more (cancelled meanwhile)."""
    try:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


class ProgramProcesses:
    """One fork server for one program; thread-safe (episodes on any loop)."""

    def __init__(self, program: str):
        self.program = program
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pids: dict[str, concurrent.futures.Future] = {}
        self._exits: dict[str, concurrent.futures.Future] = {}
        self._ready: concurrent.futures.Future = concurrent.futures.Future()

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
                _settle(self._ready, True)
                continue
            table, value = (self._pids, message["pid"]) if "pid" in message else (self._exits, message["exited"])
            with self._lock:  # an episode forgotten (ended, cancelled) meanwhile has no future here any more
                future = table.get(message["id"])
            if future is not None:
                _settle(future, value)
        error = (process.stderr.read() or b"").decode(errors="replace").strip().splitlines()
        failure = ProgramProcessError(f"the program's fork server ended: {error[-1] if error else 'no message'}")
        with self._lock:
            waiting = [*self._pids.values(), *self._exits.values(), self._ready]
        for future in waiting:
            _settle(future, failure)

    async def run(self, job: dict[str, Any]) -> tuple[int, asyncio.Future]:
        """Start `job` (its `id` the episode's) in a child: its pid, and a future of its exit status."""
        self.start()
        pid, exited = concurrent.futures.Future(), concurrent.futures.Future()
        with self._lock:  # registered before the server can answer
            self._pids[job["id"]], self._exits[job["id"]] = pid, exited
            self._process.stdin.write((json.dumps(job) + "\n").encode())
            self._process.stdin.flush()
        return await asyncio.wrap_future(pid), asyncio.wrap_future(exited)

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
