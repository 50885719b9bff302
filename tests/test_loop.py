"""The main command end to end: `python -m orchestrate.rl` with real vLLM servers and the
real accelerate-launched trainer, on a tiny model; then killed during training and resumed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForCausalLM

from orchestrate.loop.metrics import read_metrics
from tapes import read_tapes

pytestmark = pytest.mark.vllm


def command(model_dir, run_dir, iterations=2, *extra, eval_every=2):
    return [
        sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run_dir), "--iterations", str(iterations),
        "--model.policy", str(model_dir),
        "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "4", "--rollouts.max_tokens", "12",
        "--eval.every", str(eval_every), "--eval.tasks", "4", "--eval.max_tokens", "12",
        "--server.max_model_len", "512", "--server.kv_cache_gib", "1",
        "--train.kl_coef", "0.01", "--train.lr", "1e-3",
        *extra,
    ]  # fmt: skip


def test_two_iterations_fill_the_run_directory(tiny_model_dir, tiny_run):
    """The shared `tiny_run` fixture is this module's `command(tiny_model_dir, run)`, run once per session."""
    run = tiny_run

    config = json.loads((run / "config.json").read_text())
    assert config["rollouts"]["attempts"] == 4 and config["model"]["policy"] == str(tiny_model_dir)
    assert json.loads((run / "state.json").read_text())["completed_iteration"] == 2

    for i in (1, 2):
        tapes = list(read_tapes(run / "tapes" / f"iter_{i:06d}.jsonl"))
        assert len(tapes) == 8 and {t.metadata.iteration for t in tapes} == {i}
        assert {t.metadata.policy_version for t in tapes} == {i - 1}
        for tape in tapes:
            call = tape.llm_calls[0]
            assert tape.metadata.reward in (-1.0, 0.0, 1.0)
            assert len(call.ref_logprobs) == len(call.output_token_ids) == len(call.logprobs) > 0
        assert (run / "batches" / f"{i:06d}.jsonl").exists()
    for i in (0, 2):  # evaluation names the version served: 0 before training, checkpoint 2 after iteration 2
        evals = list(read_tapes(run / "tapes" / f"eval_{i:06d}.jsonl"))
        assert len(evals) == 4
        assert (
            {t.metadata.policy_version for t in evals} == {c.policy_version for t in evals for c in t.llm_calls} == {i}
        )
    assert not list(run.rglob("*.partial")) and not list(run.rglob(".*.tmp"))

    checkpoint = run / "checkpoints" / "000002"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.config.vocab_size > 0

    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        for key in (
            "reward_mean",
            "success_rate",
            "parse_failure_rate",
            "truncation_rate",
            "completion_tokens_mean",
            "kl_ref",
            "train_loss",
            "train_entropy",
            "time_generate",
            "time_reward",
            "time_reference",
            "time_train",
            "time_weight_sync",
            "time_other",
            "wall_time",
            "elapsed_s",
            "trainer_busy_frac",
            "generator_busy_frac",
        ):
            assert key in m, key
    assert "eval_success_rate" in metrics[0] and "eval_success_rate" in metrics[2]
    assert (run / "plots" / "curves.png").stat().st_size > 10_000
    assert (run / "logs" / "policy-0.log").exists() and (run / "logs" / "reference.log").exists()
    assert (run / "logs" / "launcher.log").exists()
    assert "iter 2/2" in (run.parent / "console.txt").read_text()


def children_of_run(run_dir):
    """Processes whose command line names the run directory (servers' logs, trainer)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(run_dir) in cmdline:
                pids.append(int(entry))
    return pids


def test_ppo_at_async_level_1_killed_while_generation_and_training_overlap_then_resumed(
    tiny_model_dir, tiny_servers_by_url, tmp_path
):
    """`--train.algorithm ppo` (a separate critic, KL in the reward) at `--run.async_level 1` with in-flight
    weight swaps, through real vLLM servers (the session's, by URL) and the real trainer: the orchestrator
    writes batch b+1 while the trainer trains batch b; SIGKILL it right
    then and resume with the same command. The children go with the orchestrator; the resumed run keeps the
    tapes (and versions) it had, trains every batch exactly once, and no batch comes from a policy more than one
    version behind the trainer. The trainer reports the critic's metrics and writes the advantages it used with
    the critic's values, and the checkpoint vLLM loads is the policy alone (the critic lives in trainer_state/,
    resumable). Three iterations: batch 3 is generated while batch 2 trains, the steady state. (The synchronous loop's kills, in every phase, are bench/bench_kill.py's.)"""
    from contract.rundir import read_advantages

    run = tmp_path / "run"
    # batches of one sample per optimizer step keep the trainer busy long enough to be caught in the act
    argv = command(
        tiny_model_dir, run, 3, "--run.async_level", "1", "--train.steps_per_epoch", "8", "--train.epochs", "4",
        "--train.algorithm", "ppo", "--train.ppo.kl_in_reward", "0.05", "--train.ppo.critic_lr", "1e-4",
        "--run.in_flight_swaps", "true",  # new weights under the calls in flight: the servers pause, not drain
        *tiny_servers_by_url,  # the session's servers by URL: they outlive the kill, as a user's would
    )  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    caught = None
    deadline = time.monotonic() + 600
    while caught is None and time.monotonic() < deadline:
        assert proc.poll() is None, "finished before an overlap was seen:\n" + proc.stdout.read().decode()[-3000:]
        try:
            state = json.loads((run / "learner_status.json").read_text())
        except (OSError, json.JSONDecodeError):
            state = {}
        b = state.get("batch_in_progress") if state.get("status") == "training" else None
        if b and (run / "batches" / f"{b + 1:06d}.jsonl").exists():
            caught = b
        time.sleep(0.02)
    assert caught, "never saw batch b+1 written while batch b was training"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ahead = (run / "tapes" / f"iter_{caught + 1:06d}.jsonl").read_bytes()  # written, not yet trained on
    deadline = time.monotonic() + 60
    while children_of_run(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not children_of_run(run), "children outlived the orchestrator"

    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Resuming" in out.stdout
    assert (run / "tapes" / f"iter_{caught + 1:06d}.jsonl").read_bytes() == ahead  # kept, with its versions
    assert json.loads((run / "state.json").read_text())["completed_iteration"] == 3
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]
    steps = [json.loads(line) for line in (run / "train_metrics.jsonl").read_text().splitlines()]
    for batch in (1, 2, 3):
        assert len([s for s in steps if s["batch"] == batch]) == 32, f"batch {batch} not trained exactly once"
    assert not list(run.rglob("*.partial"))
    for i in (1, 2, 3):
        tapes = list(read_tapes(run / "tapes" / f"iter_{i:06d}.jsonl"))
        for tape in tapes:
            versions = [c.policy_version for c in tape.llm_calls]
            assert versions and tape.metadata.policy_version == min(versions)
            # the trainer trains batch i with version i - 1: at most async_level (1) versions ahead
            assert i - 2 <= min(versions) and max(c.newest_version for c in tape.llm_calls) <= i - 1
    for m in metrics[1:]:
        assert 0 <= m["trainer_busy_frac"] <= 1 and 0 <= m["generator_busy_frac"] <= 1
        assert 0 <= m["lag_mean"] <= m["lag_max"] <= 1 and m["stale_dropped"] == 0  # the trainer's own count
        if m["lag_max"] == 0:  # the mismatch is measured over lag-0 tokens (batch 1's always are)
            assert m["train_mismatch_abs_logp"] >= 0 and m["train_tis_ratio_max"] > 0
    assert metrics[1]["lag_max"] == 0 and "train_mismatch_abs_logp" in metrics[1]
    evals = list(read_tapes(run / "tapes" / "eval_000002.jsonl"))
    assert {c.policy_version for t in evals for c in t.llm_calls} == {2}

    # PPO: the critic's metrics, its values in the advantages, a policy-only checkpoint, a resumable critic
    keys = ("value_loss", "vf_clip_frac", "value_mean", "returns_mean", "explained_variance", "clip_frac")
    for s in steps:
        for key in (*keys, "critic_grad_norm"):
            assert key in s, key
    assert steps[0]["value_mean"] == 0.0  # a zero-initialised value head: the first batch's values
    assert all("train_value_loss" in m for m in metrics[1:])
    for i in (1, 2, 3):
        learned = read_advantages(run, i)
        assert len(learned) == 8 and all("value" in t for turns in learned.values() for t in turns)
    checkpoint = run / "checkpoints" / "000003"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert not any("value" in k for k in model.state_dict())
    assert len(list((checkpoint / "trainer_state").glob("model_1*"))) == 1  # the critic, resumable


def test_changed_options_on_resume_are_refused(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"rollouts": {"attempts": 99}}))
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n')  # it played (one that played nothing starts again)
    out = subprocess.run(command(tiny_model_dir, run), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--rollouts.attempts" in out.stderr


def test_gsm8k_preset_runs_on_cpu_with_model_data_and_counts_overridden(tiny_model_dir, tiny_servers_by_url, tmp_path):
    """The reference workload's preset, unchanged but for the model, the data files and the counts."""
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}",
        }
        for a, b in ((3, 4), (10, 990), (7, 8), (12, 30))
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "orchestrate.rl", "--preset", "gsm8k", "--run-dir", str(run), "--iterations", "1",
           "--model.policy", str(tiny_model_dir),
           "--env.options.train", str(data), "--env.options.test", str(data),
           "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "2", "--rollouts.max_tokens", "8",
           "--eval.every", "1", "--eval.max_tokens", "8",
           "--server.max_model_len", "512", "--server.kv_cache_gib", "1", "--train.token_budget", "1024",
           *tiny_servers_by_url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    config = json.loads((run / "config.json").read_text())
    assert config["env"]["id"] == "math:gsm8k" and config["train"]["kl_coef"] > 0  # the preset's own settings
    assert config["rollouts"]["temperature"] == 0.7 and config["eval"]["tasks"] is None
    tapes = list(read_tapes(run / "tapes" / "iter_000001.jsonl"))
    assert len(tapes) == 4 and all(len(t.llm_calls[0].ref_logprobs) > 0 for t in tapes)
    assert len(list(read_tapes(run / "tapes" / "eval_000001.jsonl"))) == 4  # the whole test file
    assert (run / "checkpoints" / "000001" / "config.json").is_file()


def test_game_preset_chains_every_call_and_replays(embedded_policy_by_url, tmp_path):
    """`--preset game` (guess the number, several turns) with the embedded model through real vLLM and the
    real trainer, at reduced counts (one iteration; later iterations are the other loop tests'): every call
    of every episode extends the previous prompt + output exactly, an episode is one training sample, the
    learner's advantages are written, and every tape replays identically against the environment."""
    import asyncio

    from contract.rundir import read_advantages
    from orchestrate.after.replay import replay_tape
    from orchestrate.loop.setup import agent_from_run_config

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "orchestrate.rl", "--preset", "game", "--run-dir", str(run), "--iterations", "1",
           "--rollouts.tasks_per_iteration", "3", "--rollouts.attempts", "2", "--eval.every", "0",
           "--server.kv_cache_gib", "1", *embedded_policy_by_url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    agent = agent_from_run_config(run / "config.json")
    calls = later = 0
    tapes = list(read_tapes(run / "tapes" / "iter_000001.jsonl"))
    assert len(tapes) == 6
    for tape in tapes:
        assert tape.context["env"]["id"] == "game:guess_the_number"
        for before, after in zip(tape.llm_calls, tape.llm_calls[1:]):
            n = len(before.prompt_token_ids) + len(before.output_token_ids)
            assert after.extends_previous is True
            assert after.prompt_token_ids[:n] == before.prompt_token_ids + before.output_token_ids
            later += 1
        calls += len(tape.llm_calls)
        replayed, diff = asyncio.run(replay_tape(tape, agent))
        assert diff.identical, diff.report()
    batch = [json.loads(line) for line in (run / "batches" / "000001.jsonl").read_text().splitlines()]
    assert len(batch) == 6  # one sample per episode, whatever its turns
    assert [len(s["turns"]) for s in batch] == [t.metadata.turns for t in tapes]
    learned = read_advantages(run, 1)
    assert set(learned) == {t.metadata.id for t in tapes}
    assert all(len(learned[t.metadata.id]) == t.metadata.turns for t in tapes)
    assert later > 0, "no episode went past its first turn"
    metrics = read_metrics(run / "metrics.jsonl")
    assert all(m.get("prompt_mismatches", 0) == 0 for m in metrics)
    assert [m["iteration"] for m in metrics] == [1]  # no evaluation (python_tool's test has one)
    assert "turns_mean" in metrics[0] and metrics[0]["turns_mean"] > 1


def test_python_tool_preset_with_tool_calls_on_its_tapes(embedded_policy_by_url, tmp_path):
    """`--preset python_tool` (the embedded model multiplies with a python tool run in the bwrap sandbox)
    through real vLLM and the real trainer at reduced counts (one iteration of 12 episodes): the tapes hold typed tool calls and their
    results (the sandbox's output, exit code), each call chains token-exactly, the iteration's metrics
    count tool calls, and a tape with a tool call replays identically (the code re-run in the sandbox)."""
    import asyncio

    from orchestrate.after.replay import replay_tape
    from orchestrate.loop.setup import agent_from_run_config
    from tapes.tape import ToolCallAction, ToolResultObservation

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "orchestrate.rl", "--preset", "python_tool", "--run-dir", str(run), "--iterations",
           "1", "--rollouts.tasks_per_iteration", "4", "--rollouts.attempts", "3", "--eval.every", "0",
           "--server.kv_cache_gib", "1", *embedded_policy_by_url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tapes = list(read_tapes(run / "tapes" / "iter_000001.jsonl"))
    assert len(tapes) == 12 and not any(t.metadata.error for t in tapes)
    with_tool = [t for t in tapes if any(isinstance(s, ToolCallAction) for s in t.steps)]
    assert with_tool, "no episode called the tool"
    for tape in tapes:
        assert tape.context["env"]["tools"] == ["python"]
        for _before, after in zip(tape.llm_calls, tape.llm_calls[1:]):
            assert after.extends_previous is True
        calls = [s for s in tape.steps if isinstance(s, ToolCallAction)]
        results = [s for s in tape.steps if isinstance(s, ToolResultObservation)]
        assert [c.turn for c in calls] == [r.turn for r in results]
        for call, result in zip(calls, results):
            assert call.tool == result.tool == "python" and call.text.endswith("</python>")
            assert call.call in call.text and result.text.startswith("<output>")
            assert isinstance(result.info["exit_code"], int) and result.reward == 0.0
    (metrics,) = read_metrics(run / "metrics.jsonl")  # iteration 1's (no evaluation)
    assert metrics["tool_calls_mean"] > 0
    replayed, diff = asyncio.run(replay_tape(with_tool[0], agent_from_run_config(run / "config.json")))
    assert diff.identical, diff.report()
    assert any("python tool call" in line for line in diff.how)
