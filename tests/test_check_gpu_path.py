"""bench/check_gpu_path.py without a server: its options and check list, and its harness (a check that
raises or runs past its timeout is a FAIL, one that needs CUDA is a SKIP here). Its real run: `--cpu`
(docs/set-up.md, "Checking a GPU machine")."""

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "check_gpu_path", Path(__file__).parent.parent / "bench" / "check_gpu_path.py"
)
gpu_check = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpu_check  # its dataclasses look their module up
spec.loader.exec_module(gpu_check)

EXPECTED = ["serve", "disk_reload", "sleep_wake", "colocated", "loop_gsm8k_1b", "gloo", "corrupt", "nccl_one_gpu",
            "loop_embedded"]  # fmt: skip


def test_list_prints_every_check_in_order(capsys):
    assert gpu_check.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == EXPECTED
    assert all(("needs CUDA" in line) == c.cuda for line, c in zip(lines, gpu_check.CHECKS))
    # what matters most runs first, and fits one call of the device tool's budget even if each of its checks
    # takes its longest; so do the rest, a later call's (--only): no hang leaves the 1B loop "not run"
    first = [c for c in gpu_check.CHECKS if c.name in gpu_check.FIRST_CALL]
    assert [c.name for c in first] == EXPECTED[: len(first)] == list(gpu_check.FIRST_CALL)
    assert sum(c.timeout_s for c in first) <= gpu_check.BUDGET_S
    assert sum(c.timeout_s for c in gpu_check.CHECKS if c not in first) <= gpu_check.BUDGET_S


def test_an_unknown_check_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--list", "--only", "serve,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err


def context(tmp_path, cuda=False):
    return gpu_check.Context(work=tmp_path, cuda=cuda)


def run(fn, tmp_path, timeout_s=5.0, cuda=False):
    return gpu_check.run_check(gpu_check.Check("x", timeout_s, cuda, fn), context(tmp_path))


def test_a_check_that_raises_is_a_fail_with_its_error(tmp_path):
    def broken(ctx):
        raise RuntimeError("boom")

    result = run(broken, tmp_path)
    assert result["status"] == "FAIL" and "RuntimeError: boom" in result["why"] and "boom" in result["trace"]

    def false(ctx):
        gpu_check.require(1 > 2, "one is not above two")

    result = run(false, tmp_path)
    assert result["status"] == "FAIL" and "one is not above two" in result["why"]


def test_a_check_past_its_timeout_is_a_fail_and_its_servers_are_stopped(tmp_path):
    stopped = threading.Event()

    class Server:
        def stop(self):
            stopped.set()

    def hangs(ctx):
        ctx.servers.append(Server())
        time.sleep(60)

    start = time.monotonic()
    result = gpu_check.run_check(gpu_check.Check("x", 0.5, False, hangs), context(tmp_path))
    assert time.monotonic() - start < 5
    assert result["status"] == "FAIL" and "timeout" in result["why"]
    assert stopped.is_set()  # what the hung check waits on is gone
    assert gpu_check.targets({"x": result})["hung"] == ["x"]


def test_a_check_gets_at_most_the_runs_budget_left(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_CHECK_S", 0.5)
    result = gpu_check.run_check(gpu_check.Check("x", 60, False, lambda ctx: time.sleep(60)), context(tmp_path), 1.2)
    assert result["status"] == "FAIL" and "timeout of 1 s" in result["why"] and result["seconds"] < 5
    result = gpu_check.run_check(gpu_check.Check("x", 60, False, lambda ctx: {}), context(tmp_path), 0.3)
    assert result["status"] == "NOT RUN" and result["why"] == "0 s of the run's budget left"
    # not a failure: a later call runs it (--only); the targets name it
    assert gpu_check.targets({"x": result})["not_run"] == ["x"]


def test_skips_passes_and_the_main_thread(tmp_path):
    assert run(lambda ctx: {"a": 1}, tmp_path, cuda=True) == {"status": "SKIP", "why": "needs CUDA", "seconds": 0.0,
                                                             "figures": {}}  # fmt: skip

    def skip(ctx):
        raise gpu_check.Skip("no server")

    assert run(skip, tmp_path)["why"] == "no server"
    # a server is spawned by the main thread (its parent-death signal is the thread's): on_main runs it there
    result = run(lambda ctx: {"main": ctx.on_main(lambda: threading.current_thread() is threading.main_thread())},
                 tmp_path)  # fmt: skip
    assert result["status"] == "PASS" and result["figures"] == {"main": True}


def test_a_cpu_run_of_the_cuda_checks_only_records_them_skipped(tmp_path, monkeypatch):
    """The whole main path (record, log, exit status) without a server: only checks that need CUDA."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what --cpu sets, restored after the test
    monkeypatch.setenv("TAPELOOP_CACHE", str(tmp_path / "cache"))  # what main sets by default, likewise
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        monkeypatch.setenv(name, "1")
    cuda_only = ",".join(c.name for c in gpu_check.CHECKS if c.cuda)
    assert gpu_check.main(["--cpu", "--only", cuda_only, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "check_gpu_path.json").read_text())
    assert record["device"].startswith("CPU") and "torch" in record["versions"]
    assert {r["status"] for r in record["checks"].values()} == {"SKIP"}
    assert "SKIP loop_gsm8k_1b" in (tmp_path / "check_gpu_path.log").read_text()
    assert record["targets"]["every_check_passes"] is False and record["targets"]["gsm8k_1b_peak_share"] is None


def test_the_padded_tokenizer_decodes_every_id_of_its_vocabulary():
    tokenizer, vocab = gpu_check.padded_byte_tokenizer(1000)
    assert len(vocab) == len(tokenizer) == 1000 == len(set(vocab.values()))
    assert tokenizer.decode(tokenizer.encode("12 + 30 = 42")) == "12 + 30 = 42"
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(1000))
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_the_loop_commands_are_the_loops_options(tmp_path):
    """The colocated loop's command lines parse as orchestrate.rl's, the gsm8k one with its local task file;
    here, with no GPU, colocation itself is refused (that is the GPU's to run), so it is parsed without it."""
    from orchestrate.loop.command_line import options, parse_args
    from orchestrate.loop.config_checks import ConfigError

    names = {name for name, _, _ in options()}
    assert {"server.colocate", "server.weight_transfer"} <= names
    for preset, extra in (("embedded", []), ("gsm8k", gpu_check.gsm8k_options(tmp_path))):
        argv = gpu_check.loop_command(preset, Path("/m"), Path("/r"), extra)[3:]  # after `python -m orchestrate.rl`
        assert argv[argv.index("--server.colocate") + 1] == "on"
        assert argv[argv.index("--server.weight_transfer") + 1] == gpu_check.COLOCATED
        with pytest.raises((ConfigError, SystemExit)):
            parse_args(argv)  # colocated on CPU
        i = argv.index("--server.colocate")
        _, config = parse_args(argv[:i] + argv[i + 2 :])
        assert config.run.iterations == gpu_check.ITERATIONS and config.eval.every == 0
        assert config.server.weight_transfer == gpu_check.COLOCATED


def test_figures_read_from_a_run():
    log = "INFO ... Available KV cache memory: 12.5 GiB\n... Available KV cache memory: 11.25 GiB\n"
    assert gpu_check.kv_cache_gib(log) == 11.25 and gpu_check.kv_cache_gib("nothing") is None
    log = "INFO 11-28 [gpu_model_runner.py:6845] Graph capturing finished in 12 secs, took 0.41 GiB\n"
    assert gpu_check.graph_gib(log) == 0.41 and gpu_check.graph_gib("nothing") is None
    times = {"time_train": [2.0, 4.0], "time_weight_sync": [0.5, 0.5], "time_wake": [0.5, 1.5], "time_generate": [9, 9]}
    figures = gpu_check.overhead({"phase_times_s": times})
    assert figures["overhead_s"] == [1.0, 2.0] and figures["overhead_vs_train"] == [0.5, 0.5]


FAKE_LOOP = """
import json, sys, time
from contract.rundir import RunDir
run = RunDir(sys.argv[sys.argv.index("--run-dir") + 1])
run.root.mkdir(parents=True)
for i in range(1, ITERATIONS + 1):
    for phase in ("rollouts", "training", "weight_reload"):
        run.write_phase(i, phase)
        time.sleep(0.3)
    with open(run.metrics_path, "a") as f:
        f.write(json.dumps({"iteration": i, "time_train": 2.0, "time_weight_sync": 0.5, "time_generate": 1.0}) + "\\n")
"""


def test_a_loop_is_timed_by_phase_and_its_peak_memory_sampled(tmp_path, monkeypatch):
    """run_loop on a stand-in for orchestrate.rl (it writes phase.json and metrics.jsonl as the loop does),
    the GPU's memory faked: a different amount in use in each phase."""
    import sys

    used = {"rollouts": 10.0, "training": 30.0, "weight_reload": 20.0}
    ctx = context(tmp_path)
    run_dir = tmp_path / "run"
    from contract.rundir import RunDir

    def in_use():
        phase = RunDir(run_dir).read_phase() if run_dir.is_dir() else None
        return used.get((phase or {}).get("phase"), 1.0)

    monkeypatch.setattr(gpu_check, "gpu_used_gib", in_use)
    monkeypatch.setattr(gpu_check, "gpu_total_gib", lambda: 80.0)
    monkeypatch.setattr(gpu_check, "SETTLE_S", 0.5)  # the fake's last phase holds its memory for good
    code = FAKE_LOOP.replace("ITERATIONS", str(gpu_check.ITERATIONS))
    figures = gpu_check.run_loop(ctx, "fake", [sys.executable, "-c", code, "--run-dir", str(run_dir)])
    assert figures["peak_gib"] == 30.0 and figures["peak_share"] == 30.0 / 80
    assert figures["peak_gib_by_phase"]["training"] == 30.0 and figures["peak_gib_by_phase"]["weight_reload"] == 20.0
    assert figures["phase_times_s"]["time_train"] == [2.0] * gpu_check.ITERATIONS
    assert gpu_check.overhead(figures)["overhead_vs_train"] == [0.25] * gpu_check.ITERATIONS
    assert figures["memory_back_s"] is None  # 20 GiB still in use after it, against 1 before

    with pytest.raises(gpu_check.CheckFailed, match="exited with 1"):
        gpu_check.run_loop(
            ctx, "fails", [sys.executable, "-c", "raise SystemExit(1)", "--run-dir", str(tmp_path / "r2")]
        )


def test_after_a_loop_the_gpus_memory_is_waited_for(monkeypatch):
    """A loop's servers stop up to 10 s after it: the next check's server would find too little free."""
    readings = iter([30.0, 20.0, 12.0, 10.5])
    monkeypatch.setattr(gpu_check, "gpu_used_gib", lambda: next(readings, 10.5))
    monkeypatch.setattr(gpu_check.time, "sleep", lambda s: None)
    assert gpu_check.memory_back(10.0) is not None and next(readings, "done") == "done"  # back within 1 GiB
    monkeypatch.setattr(gpu_check, "gpu_used_gib", lambda: 30.0)
    monkeypatch.setattr(gpu_check, "SETTLE_S", 0.05)
    assert gpu_check.memory_back(10.0) is None


def test_the_ends_of_the_logs_come_back(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "LOG_TAIL_BYTES", 4)
    (tmp_path / "logs" / "runs").mkdir(parents=True)
    (tmp_path / "logs" / "policy.log").write_text("start ... the end")
    (tmp_path / "logs" / "runs" / "loop.out").write_text("ok")
    gpu_check.keep_logs(tmp_path / "logs", tmp_path / "out")
    assert (tmp_path / "out" / "policy.log").read_text() == " end"
    assert (tmp_path / "out" / "runs" / "loop.out").read_text() == "ok"
    # a loop's run: its logs come back, not its checkpoints
    run = tmp_path / "runs" / "loop"
    (run / "logs").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "trainer.log").write_text("trained")
    (run / "logs" / "policy-0.log").write_text("served")
    (run / "checkpoints" / "model.safetensors").write_text("weights")
    gpu_check.keep_logs(tmp_path / "runs", tmp_path / "out" / "runs", "*.log")
    kept = sorted(p.relative_to(tmp_path / "out" / "runs").as_posix() for p in (tmp_path / "out" / "runs").rglob("*.*"))
    assert kept == ["loop.out", "loop/logs/policy-0.log", "loop/trainer.log"]


class FakeServer:
    """What sleep_wake asks of a server, with the GPU's memory it holds asleep and awake."""

    served_model_name = "policy"

    def __init__(self, folder, frees_gib, decodes_after_wake=None):
        self.model = str(folder)
        self.log_path = folder / "server.log"
        self.log_path.write_text("... Available KV cache memory: 2.0 GiB\n")
        (folder / "model.safetensors").write_bytes(b"\0" * 2**20)
        self.used, self.frees, self.asleep, self.stopped = 10.0, frees_gib, False, False
        self.decoded = [("a", -0.5)] * gpu_check.DECODE_TOKENS  # greedy decoding's tokens and log-probs
        self.decodes_after_wake, self.woken = decodes_after_wake, False

    def probe_logprobs(self):
        return [-1.0, -2.0]

    def reset_prefix_cache(self):
        pass

    def _post(self, route, json=None, timeout=None):
        assert route == "/v1/completions" and json["temperature"] == 0.0 and json["ignore_eos"]
        decoded = self.decodes_after_wake if self.woken and self.decodes_after_wake else self.decoded
        tokens, logprobs = zip(*decoded[: json["max_tokens"]])

        class Response:
            json = staticmethod(lambda: {"choices": [{"logprobs": {"tokens": list(tokens),
                                                                   "token_logprobs": list(logprobs)}}]})  # fmt: skip

        return Response()

    def sleep(self):
        self.asleep, self.used = True, self.used - self.frees

    def wake_up(self):
        self.asleep, self.used, self.woken = False, self.used + self.frees, True

    def get(self, route):
        class Response:
            json = staticmethod(lambda: {"is_sleeping": self.asleep})

        return Response()

    def stop(self):
        self.stopped = True


@pytest.mark.parametrize("frees", [2.5, 1.0])
def test_sleep_must_free_the_weights_and_the_kv_cache(tmp_path, monkeypatch, frees):
    server = FakeServer(tmp_path, frees)
    ctx = context(tmp_path, cuda=True)
    ctx.state["disk_server"] = server
    ctx.state["idle_gib"] = 6.0  # in use before serve started the server (serve measures it)
    monkeypatch.setattr(gpu_check, "gpu_used_gib", lambda: server.used)
    result = gpu_check.run_check(next(c for c in gpu_check.CHECKS if c.name == "sleep_wake"), ctx)
    if frees > 2.0:  # the KV cache (2 GiB) and the weights (1 MiB); the server is kept for the colocated check
        assert result["status"] == "PASS" and result["figures"]["freed_gib"] == frees and not server.stopped
        # what the sleeping server keeps, against the memory plan's allowance for it
        assert result["figures"]["sleeping_gib"] == 10.0 - frees - 6.0
        from orchestrate.loop.memory_plan import SLEEPING_GIB

        target = gpu_check.targets({"sleep_wake": result})
        assert target["sleeping_server_gib"] == 10.0 - frees - 6.0 and target["plan_sleeping_gib"] == SLEEPING_GIB
    else:
        assert result["status"] == "FAIL" and "sleep freed 1.00 GiB" in result["why"]


@pytest.mark.parametrize("after, why", [
    ([("b", -0.5)] + [("a", -0.5)] * 15, "after wake, greedy decoding gave other tokens"),
    ([("a", -0.5)] * 15 + [("a", -3.0)], "after wake: decoded tokens' max |logp gap| 2.50e+00"),
    ([("a", -0.5)] * 15 + [("a", -0.501)], None),  # within DECODE_BOUND
])  # fmt: skip
def test_after_wake_the_server_must_decode_what_it_decoded_before(tmp_path, monkeypatch, after, why):
    """A level-1 sleep discards the KV cache's pool, which on vLLM 0.26 also holds the block tables and attention
    buffers decoding reads: the prompt's log-probs (one prefill) would not show a decode gone wrong; greedy decoding
    before and after does."""
    server = FakeServer(tmp_path, 2.5, decodes_after_wake=after)
    ctx = context(tmp_path, cuda=True)
    ctx.state["disk_server"] = server
    monkeypatch.setattr(gpu_check, "gpu_used_gib", lambda: server.used)
    result = gpu_check.run_check(next(c for c in gpu_check.CHECKS if c.name == "sleep_wake"), ctx)
    if why is None:
        assert result["status"] == "PASS" and result["figures"]["decode_gap_after_wake"] == pytest.approx(0.001)
    else:
        assert result["status"] == "FAIL" and why in result["why"]
