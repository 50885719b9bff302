"""orchestrate.eval: what it evaluates, what it writes, resume, bad input (a scripted server stands in for vLLM),
and on a real server: the loop's held-out figure is eval's on the same checkpoint and seeds."""

from __future__ import annotations

import json
import re
import shutil
import signal
import zlib
from pathlib import Path

import pytest

from orchestrate import eval as eval_command
from orchestrate.loop.eval_stats import ks_for, summarize
from orchestrate.loop.evaluation import task_results
from tapes.store import read_tapes
from tests.scripted import scripted_call

QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


class StandIn:
    served_model_name = "policy"

    def __init__(self, switched=None):
        self.switched = [] if switched is None else switched  # what the server was switched to, in order

    def reload_weights(self, path, verify=True):
        self.switched.append(("weights", str(path)))

    def load_adapter(self, name, path, inplace=True):
        self.switched.append(("adapter", name))

    def unload_adapter(self, name):
        self.switched.append(("unloaded", name))

    def stop(self):
        pass


@pytest.fixture
def scripted(monkeypatch, tokenizer):
    """The command's server and client replaced: each call answers the last question right or wrong, decided
    by a hash of (question, how many times it was asked), so tasks differ and samples of one task differ.
    Returns the record of calls made and the policies served."""
    seen = {"calls": 0, "policies": [], "asked": {}, "switched": []}

    class Client:
        def __init__(self, endpoints, tokenizer_=None, *, model="", policy_version=0, **kw):
            self.model, self.version = model, policy_version

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            pass

        async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
            seen["calls"] += 1
            a, b = map(int, QUESTION.findall(messages[-1]["content"])[-1])
            k = seen["asked"][(a, b)] = seen["asked"].get((a, b), 0) + 1
            right = zlib.crc32(f"{a}+{b}/{k if sampling.temperature > 0 else 0}".encode()) % 3 != 0
            text = f"\\boxed{{{a + b if right else a + b + 1}}}"
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [
                tokenizer.convert_tokens_to_ids("<|im_end|>")
            ]
            call = scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text)
            call.policy_version, call.model = self.version, self.model
            return call

    def start(self):
        seen["policies"].append(self.policy)
        self.server = StandIn(seen["switched"])
        return self

    monkeypatch.setattr("orchestrate.loop.setup.PolicyServer.start", start)
    monkeypatch.setattr("orchestrate.serving.llm.VLLMClient", Client)
    return seen


def run_eval(*args, capsys):
    try:
        code = eval_command.main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_model_evaluated_n_times_per_task_writes_tapes_figures_and_a_summary(tmp_path, scripted, capsys):
    out = tmp_path / "ev"
    code, stdout, err = run_eval("smollm2", "--tasks", "0:6", "--n", 4, "--temperature", 1.0, "--out", out,
                                 "--no-progress", capsys=capsys)  # fmt: skip
    assert code == 0, err
    record = json.loads((out / "eval.json").read_text())
    tapes = list(read_tapes(out / "tapes" / "eval_000000.jsonl"))
    assert len(tapes) == 24 and scripted["calls"] == 24
    assert sorted({t.context["env"]["seed"] for t in tapes}) == list(range(6))
    assert {t.context["env"]["split"] for t in tapes} == {"test"}
    # the figures are eval_stats' of the tapes written: one source
    expected = summarize(task_results(tapes), ks_for(4))
    for name in ("mean_reward", "pass@1", "pass@2", "pass@4", "maj@4"):
        assert record[name] == expected[name], name  # JSON keeps floats exactly
    assert 0 < record["pass@1"]["value"] < record["pass@4"]["value"] <= 1
    assert record["settings"]["n"] == 4 and record["settings"]["tasks"] == [0, 6]
    assert "pass@4" in (out / "summary.md").read_text() and (out / "pass_at_k.png").stat().st_size > 0
    assert "pass@1" in stdout and "[" in stdout  # the headline with its interval


def test_a_killed_evaluation_resumes_without_playing_finished_tasks(tmp_path, scripted, capsys):
    out = tmp_path / "ev"
    args = ("smollm2", "--tasks", "0:5", "--n", 2, "--temperature", 1.0, "--out", out, "--no-progress")
    assert run_eval(*args, capsys=capsys)[0] == 0
    path = out / "tapes" / "eval_000000.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    first = json.loads((out / "eval.json").read_text())
    # as a kill leaves it: three tasks whole, one sample of the fourth, and a torn line
    path.write_text("".join(lines[:7]) + lines[7][:50])
    (out / "eval.json").unlink()
    (out / "tapes" / "forks").mkdir()  # orchestrate.after.fork's of its tapes: the folder is still the evaluation's
    calls = scripted["calls"]
    code, stdout, err = run_eval(*args, capsys=capsys)
    assert code == 0, err
    assert scripted["calls"] - calls == 4  # tasks 3 and 4 again, 2 samples each; nothing else
    assert "3 done before, 2 to play" in stdout
    tapes = list(read_tapes(path))
    assert len(tapes) == 10 and sorted(t.context["env"]["seed"] for t in tapes) == sorted([0, 1, 2, 3, 4] * 2)
    assert json.loads((out / "eval.json").read_text())["settings"] == first["settings"]


def test_ctrl_c_ends_an_evaluation_at_once_and_the_same_command_plays_the_rest(
    tmp_path, scripted, capsys, monkeypatch, terminal_sigint
):
    """Ctrl-C after three tasks, where the play swallows a cancel (asyncio.run turns a SIGINT into one, and a
    run went on after it): the evaluation ends at once with 130 and one line, the three are kept, and the same
    command plays the other two."""
    import orchestrate.loop.evaluation as evaluation
    from tests.test_eval_overlap import interrupt_where_a_cancel_is_swallowed

    play_tasks = evaluation.play_tasks

    async def interrupted(context, seeds, *args, **kwargs):
        await play_tasks(context, seeds[:3], *args, **kwargs)
        await interrupt_where_a_cancel_is_swallowed()
        await play_tasks(context, seeds[3:], *args, **kwargs)

    monkeypatch.setattr(evaluation, "play_tasks", interrupted)
    out = tmp_path / "ev"
    args = ("smollm2", "--tasks", "0:5", "--n", 1, "--out", out, "--no-progress")
    code, _, err = run_eval(*args, capsys=capsys)
    assert code == 130 and "Interrupted. What finished is kept" in err and scripted["calls"] == 3
    assert (
        not (out / "eval.json").exists() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )  # as before
    monkeypatch.setattr(evaluation, "play_tasks", play_tasks)
    code, stdout, err = run_eval(*args, capsys=capsys)
    assert code == 0, err
    assert "3 done before, 2 to play" in stdout and scripted["calls"] == 5


def test_greedy_twice_gives_the_same_numbers(tmp_path, scripted, capsys):
    records = []
    for name in ("a", "b"):
        assert run_eval("smollm2", "--tasks", 8, "--out", tmp_path / name, "--no-progress", capsys=capsys)[0] == 0
        records.append(json.loads((tmp_path / name / "eval.json").read_text()))
    assert records[0]["pass@1"] == records[1]["pass@1"] and records[0]["per_task"] == records[1]["per_task"]
    assert records[0]["settings"]["temperature"] == 0.0  # the preset's eval temperature with one sample


def test_a_run_is_evaluated_at_its_version_and_two_are_compared_on_the_same_tasks(tmp_path, scripted, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    from orchestrate.loop.command_line import resolve

    (run / "config.json").write_text(json.dumps(resolve("embedded", {}).model_dump(mode="json")))
    code, stdout, err = run_eval(run, "--tasks", 3, "--no-progress", capsys=capsys)
    assert code == 0, err
    assert scripted["policies"][-1].version == 0 and (run / "evals").is_dir()  # no checkpoint yet: the initial model
    code, _, err = run_eval(run, "--version", 3, "--tasks", 3, capsys=capsys)
    assert code == 2 and "--version 3" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_eval(f"{run}@0", "--version", 2, "--tasks", 3, capsys=capsys)  # two versions named
    assert code == 2 and "--version 2" in err and "names version 0" in err and len(err.strip().splitlines()) == 1

    out = tmp_path / "cmp"
    code, stdout, err = run_eval("--compare", "smollm2", f"{run}@0", "--tasks", 4, "--n", 2, "--temperature", 1.0,
                                 "--out", out, "--no-progress", capsys=capsys)  # fmt: skip
    assert code == 0, err
    record = json.loads((out / "compare.json").read_text())
    a = {t.metadata.task_id for t in read_tapes(out / "a" / "tapes" / "eval_000000.jsonl")}
    b = {t.metadata.task_id for t in read_tapes(out / "b" / "tapes" / "eval_000000.jsonl")}
    assert a == b and len(a) == 4
    assert "pass@1" in record and "flipped" in record and "B - A" in stdout
    assert (out / "compare.md").is_file() and (out / "compare.png").is_file()


@pytest.mark.parametrize(
    "args, words",
    [
        (["/no/such/folder"], ["target", "/no/such/folder"]),
        (["no-such-model-xyz"], ["target"]),
        (["smollm2", "--env.id", "math:nope"], ["--env.id"]),
        (["smollm2", "--split", "dev"], ["--split"]),
        (["smollm2", "--tasks", "490:510"], ["--tasks", "500"]),
        (["smollm2", "--tasks", "5:5"], ["--tasks", "empty"]),
        (["smollm2", "--tasks", "x"], ["--tasks"]),
        (["smollm2", "--n", 2, "--k", "1,4", "--temperature", 1], ["--k", "4"]),
        (["smollm2", "--n", 4, "--temperature", 0], ["--n 4", "temperature 0"]),
        (["smollm2", "--n", 0], ["--n"]),
        (["smollm2", "--n", 5000, "--temperature", 1], ["--n", "1024"]),
        (["smollm2", "--max-tokens", 5000], ["--max-tokens", "max_model_len"]),
        (["smollm2", "--temperature", "nan"], ["--temperature"]),
        (["smollm2", "--version", 2], ["--version", "not a run"]),
        (["smollm2", "--key-file", "k"], ["--key-file"]),
        (["http://127.0.0.1:9"], ["$VLLM_API_KEY"]),
        ([], ["target"]),
        (["--compare", "smollm2"], ["--compare"]),
        (["smollm2", "--versions", "all"], ["--versions", "not a run"]),
        (["smollm2", "--step", 2], ["--step", "--versions"]),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, scripted, capsys, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    code, _, err = run_eval(*args, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert all(w in line for w in words), line
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
    assert scripted["policies"] == []


@pytest.mark.vllm
@pytest.mark.slow
def test_the_loops_held_out_figure_is_evals_on_the_same_checkpoint_and_seeds(tiny_run, tiny_policy_server, tmp_path,
                                                                             capsys):  # fmt: skip
    """tiny_run evaluated itself after iteration 2 (4 tasks, T = 0, 12 tokens); eval of its version 2 on the
    same tasks, served by a real vLLM server, samples the same tokens and gives the same figure."""
    checkpoint = tiny_run / "checkpoints" / "000002"
    assert (checkpoint / "model.safetensors").is_file()  # the clean stop wrote the weights sent in memory
    tiny_policy_server.reload_weights(checkpoint, verify=False)
    key = tmp_path / "key"
    key.write_text(tiny_policy_server.api_key)
    out = tmp_path / "ev"
    code, stdout, err = run_eval(tiny_policy_server.base_url, "--key-file", key, "--config", tiny_run / "config.json",
                                 "--tasks", 4, "--out", out, "--no-progress", capsys=capsys)  # fmt: skip
    assert code == 0, err
    loop = list(read_tapes(tiny_run / "tapes" / "eval_000002.jsonl"))
    ours = list(read_tapes(next((out / "tapes").glob("eval_*.jsonl"))))
    assert [t.metadata.task_id for t in ours] == [t.metadata.task_id for t in loop]
    assert [c.output_token_ids for t in ours for c in t.llm_calls] == [
        c.output_token_ids for t in loop for c in t.llm_calls
    ]
    metrics = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    held_out = next(m["eval_success_rate"] for m in metrics if m.get("iteration") == 2 and "eval_success_rate" in m)
    assert json.loads((out / "eval.json").read_text())["pass@1"]["value"] == pytest.approx(held_out)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_runs_versions_on_one_real_server_sample_what_the_loop_sampled(tiny_run, tmp_path, capsys):
    """--versions all on tiny_run (versions 0 and 2 on disk): one vLLM server is started for the initial model,
    then version 2's weights are reloaded into it; each version samples the tokens the loop's own held-out
    evaluation of it sampled (T = 0, the same 4 tasks)."""
    out = tmp_path / "curve"
    code, stdout, err = run_eval(tiny_run, "--versions", "all", "--tasks", 4, "--out", out, "--no-progress",
                                 capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert [p.name for p in (out / "logs").iterdir()] == ["policy.log"]  # one server for both
    sampled = {}
    for v in (0, 2):
        loop = list(read_tapes(tiny_run / "tapes" / f"eval_{v:06d}.jsonl"))
        ours = list(read_tapes(out / f"v{v}" / "tapes" / f"eval_{v:06d}.jsonl"))
        assert [t.metadata.task_id for t in ours] == [t.metadata.task_id for t in loop]
        sampled[v] = [c.output_token_ids for t in ours for c in t.llm_calls]
        assert sampled[v] == [c.output_token_ids for t in loop for c in t.llm_calls], f"version {v}"
    assert sampled[0] != sampled[2]  # training changed what the model says: the reload took
    points = json.loads((out / "curve.json").read_text())["points"]
    assert [p["version"] for p in points] == [0, 2] and points[1]["minutes"] > 0


def test_a_run_whose_loop_holds_its_lock_is_evaluated_beside_it(tmp_path, scripted, capsys):
    """Eval takes no lock the loop needs and writes only its own folder, RUN/evals/LABEL."""
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.run_lock import RunLock

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(resolve("embedded", {}).model_dump(mode="json")))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    lock = RunLock(run).acquire()  # as the running loop holds it
    try:
        code, _, err = run_eval(run, "--tasks", 2, "--no-progress", capsys=capsys)
    finally:
        lock.release()
    assert code == 0, err
    after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if (run / "evals") not in p.parents and p != run / "evals"}
    assert after == before
    assert list((run / "evals").glob("*/eval.json"))


def test_a_checkpoint_folder_is_that_version_of_its_run(tmp_path, scripted, capsys):
    from orchestrate.loop.command_line import resolve

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "000003"
    checkpoint.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(resolve("embedded", {}).model_dump(mode="json")))
    code, _, err = run_eval(checkpoint, "--tasks", 2, "--no-progress", capsys=capsys)
    assert code == 2 and "--version 3" in err and "not published" in err
    (checkpoint / "learner.json").write_text("{}")  # published, its weights sent in memory
    code, _, err = run_eval(checkpoint, "--tasks", 2, "--no-progress", capsys=capsys)
    assert code == 2 and "in memory" in err and scripted["policies"] == []
    (checkpoint / "config.json").write_text("{}")  # the weights on disk
    code, _, err = run_eval(checkpoint, "--tasks", 2, "--no-progress", capsys=capsys)
    assert code == 0, err
    assert scripted["policies"][-1].version == 3 and scripted["policies"][-1].model == checkpoint
    tapes = list(read_tapes(next((run / "evals").glob("v3-*/tapes/eval_000003.jsonl"))))
    assert {c.policy_version for t in tapes for c in t.llm_calls} == {3}


def swept_run(tmp_path):
    """A run as the loop leaves it: versions 1 (its weights sent in memory), 2 and 4 (on disk) published, and
    metrics whose records say when each came (held-out evaluations of 30 s at iterations 0 and 2, a resume
    after iteration 2)."""
    from orchestrate.loop.command_line import resolve

    run = tmp_path / "run"
    for v, on_disk in ((1, False), (2, True), (4, True)):
        folder = run / "checkpoints" / f"{v:06d}"
        folder.mkdir(parents=True)
        (folder / "learner.json").write_text("{}")
        if on_disk:
            (folder / "config.json").write_text("{}")
    (run / "config.json").write_text(json.dumps(resolve("embedded", {}).model_dump(mode="json")))
    records = [{"iteration": 0, "elapsed_s": 60.0, "time_eval": 30.0}, {"iteration": 1, "elapsed_s": 120.0},
               {"iteration": 2, "elapsed_s": 240.0, "time_eval": 30.0},
               {"iteration": 3, "elapsed_s": 90.0}, {"iteration": 4, "elapsed_s": 150.0}]  # fmt: skip
    for r in records:  # the first command started at 1000 s, the resumed one at 5000 s
        r["wall_time"] = r["elapsed_s"] + (1000.0 if r["iteration"] <= 2 else 5000.0)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_versions_of_a_run_play_on_one_server_switched_in_turn_and_make_a_curve(tmp_path, scripted, capsys):
    run = swept_run(tmp_path)
    code, stdout, err = run_eval(run, "--versions", "all", "--tasks", 3, "--no-progress", capsys=capsys)
    assert code == 0, err
    # one server, started for version 0, then switched to each next version's weights (1's are not on disk)
    assert [p.version for p in scripted["policies"]] == [0]
    assert scripted["switched"] == [("weights", str(run / "checkpoints" / f"{v:06d}")) for v in (2, 4)]
    out = next((run / "evals").glob("curve-*"))
    for v in (0, 2, 4):
        tapes = list(read_tapes(out / f"v{v}" / "tapes" / f"eval_{v:06d}.jsonl"))
        assert len(tapes) == 3 and {c.policy_version for t in tapes for c in t.llm_calls} == {v}
    curve = json.loads((out / "curve.json").read_text())
    assert [p["version"] for p in curve["points"]] == [0, 2, 4]
    # when each version came: iteration N's record less its own evaluation (version 2: 240 - 30 s); the resumed
    # command's clock goes on from 240 s; the run's evaluations before a version left out of its training minutes
    assert [p["minutes"] for p in curve["points"]] == [0.0, 3.5, 6.5]
    assert [p["training_minutes"] for p in curve["points"]] == [0.0, 3.0, 5.5]
    for point, v in zip(curve["points"], (0, 2, 4)):  # each point is that version's own eval.json figure
        assert point["pass@1"] == json.loads((out / f"v{v}" / "eval.json").read_text())["pass@1"]
    assert "| 4 | 6.5 | 5.5 |" in (out / "curve.md").read_text() and (out / "curve.png").stat().st_size > 0
    assert "curve of 3 versions" in stdout
    assert "went in memory" not in stdout  # version 2 is asked for: version 4 being newer is no news
    # again: every version is whole, nothing is played and no server starts
    calls = scripted["calls"]
    assert run_eval(run, "--versions", "all", "--tasks", 3, "--no-progress", capsys=capsys)[0] == 0
    assert scripted["calls"] == calls and len(scripted["policies"]) == 1
    # version 2's weights deleted since (a bench frees the disk once a curve is written): it stays on the curve
    (run / "checkpoints" / "000002" / "config.json").unlink()
    code, stdout, err = run_eval(run, "--versions", "all", "--tasks", 3, "--no-progress", "--out", out,
                                 capsys=capsys)  # fmt: skip
    assert code == 0, err
    again = json.loads((out / "curve.json").read_text())
    assert again["points"] == curve["points"] and "keeps versions 2 evaluated" in stdout
    # a version evaluated with other settings (2 tasks, not 3) is no point of this curve
    code, _, err = run_eval(run, "--versions", "4", "--tasks", 2, "--no-progress", "--out", tmp_path / "two",
                            capsys=capsys)  # fmt: skip
    assert code == 0, err
    shutil.copytree(tmp_path / "two" / "v4", out / "v5")
    shutil.copytree(out / "v4", out / "v6")  # the same settings under another version's name: version 4's record
    (out / "v\u00b2").mkdir()  # a name that is no version
    assert run_eval(run, "--versions", "all", "--tasks", 3, "--no-progress", "--out", out, capsys=capsys)[0] == 0
    assert [p["version"] for p in json.loads((out / "curve.json").read_text())["points"]] == [0, 2, 4]


def test_versions_lists_ranges_and_step(tmp_path, scripted, capsys):
    run = swept_run(tmp_path)
    out = tmp_path / "curve"
    code, _, err = run_eval(run, "--versions", "0,2-9", "--step", 3, "--tasks", 2, "--out", out, "--no-progress",
                            capsys=capsys)  # fmt: skip
    assert code == 0, err  # 0 and 2-9 on disk: 0, 2, 4; multiples of 3: 0; and the last chosen, 4
    assert [p["version"] for p in json.loads((out / "curve.json").read_text())["points"]] == [0, 4]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--versions", "1"], ["--versions", "no version 1 on disk", "disk: 0, 2, 4"]),
        (["--versions", "5-3"], ["--versions", "empty"]),
        (["--versions", "x"], ["--versions", "'x'"]),
        (["--versions", "7-9"], ["--versions", "none"]),
        (["--versions", "all", "--step", 0], ["--step 0"]),
        (["--versions", "all", "--version", 2], ["--versions", "--version"]),
    ],
)
def test_bad_versions_are_one_line_exit_2(tmp_path, scripted, capsys, args, words):
    run = swept_run(tmp_path)
    code, _, err = run_eval(run, *args, "--tasks", 2, capsys=capsys)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert all(w in line for w in words), line
    assert not (run / "evals").exists() and scripted["policies"] == []
    code, _, err = run_eval(f"{run}@2", "--versions", "all", capsys=capsys)
    assert code == 2 and "without @N" in err
    code, _, err = run_eval(f"{run}@abc", capsys=capsys)  # was "no such model"
    assert code == 2 and "'abc' is not a version" in err


def test_versions_with_a_config_that_is_not_lora_like_the_run_are_refused(tmp_path, scripted, capsys):
    from orchestrate.loop.command_line import resolve

    run = swept_run(tmp_path)  # whole weights
    lora = tmp_path / "lora.json"
    lora.write_text(json.dumps(resolve("embedded", {"train.lora.rank": "8"}).model_dump(mode="json")))
    code, _, err = run_eval(run, "--versions", "all", "--config", lora, "--tasks", 2, capsys=capsys)
    assert code == 2 and "--config: its train.lora.rank 8 differs" in err and len(err.strip().splitlines()) == 1
    assert scripted["policies"] == [] and not (run / "evals").exists()


def test_comparing_a_lora_runs_version_with_a_whole_weights_run_names_the_merge(tmp_path, scripted, capsys):
    """--compare serves both sides with A's config: B a LoRA run's adapter and A not is refused, naming
    --compare and the way out (not --config, which was not given)."""
    from contract.rundir import ADAPTER_CONFIG, RunDir
    from orchestrate.loop.command_line import resolve

    whole = swept_run(tmp_path)
    lora = tmp_path / "lora"
    adapter = RunDir(lora).adapter(2)
    adapter.mkdir(parents=True)
    (adapter / ADAPTER_CONFIG).write_text("{}")
    (adapter.parent / "learner.json").write_text("{}")
    (lora / "config.json").write_text(json.dumps(resolve("embedded", {"train.lora.rank": "8"}).model_dump(mode="json")))
    code, _, err = run_eval("--compare", f"{whole}@2", f"{lora}@2", "--tasks", 2, capsys=capsys)
    line = err.strip().splitlines()[-1]
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert line.startswith("error: --compare:") and "orchestrate.after.merge" in line and "--config" not in line
    assert scripted["policies"] == []


def test_versions_on_disk_are_named_in_spans():
    from orchestrate.loop.eval_settings import spans

    assert spans([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8" and spans([0]) == "0"


def test_a_lora_runs_versions_switch_adapters_and_the_base_needs_none(tmp_path):
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.policy import Policy
    from orchestrate.loop.setup import PolicyServer

    config = resolve("embedded", {"train.lora.rank": "8"})
    served = PolicyServer(Policy(Path("base"), 0, "m"), config, tmp_path, switches=True)
    served.server = StandIn()
    (tmp_path / "a3" / "judge").mkdir(parents=True)  # version 3 with a role's own adapter beside the policy's
    (tmp_path / "a3" / "judge" / "adapter_config.json").write_text("{}")
    served.switch(Policy(Path("base"), 3, "m", adapter=tmp_path / "a3"))
    shutil.rmtree(tmp_path / "a3")  # its checkpoint deleted (keep_checkpoints) while it is served
    served.switch(Policy(Path("base"), 5, "m", adapter=tmp_path / "a5"))
    served.switch(Policy(Path("base"), 0, "m"))  # the base model: no adapter to load, no weights to reload
    assert served.server.switched == [("adapter", "policy-v3"), ("adapter", "policy-judge-v3"), ("adapter", "policy-v5"),
                                      ("unloaded", "policy-v3"), ("unloaded", "policy-judge-v3"),
                                      ("unloaded", "policy-v5")]  # fmt: skip
    assert served.policy.version == 0
    with pytest.raises(RuntimeError):
        PolicyServer(Policy(Path("base"), 0, "m"), config, tmp_path).switch(Policy(Path("base"), 1, "m"))


def test_the_version_clock_knows_a_resume_by_its_start_even_when_elapsed_s_goes_on():
    """A command killed 68 s in and resumed: the resumed command's first record (75 s, its own clock) is later
    than the killed one's last; the commands' starts (wall_time - elapsed_s) tell them apart."""
    from orchestrate.loop.metrics import version_clock

    records = [{"iteration": 1, "elapsed_s": 68.0, "wall_time": 1068.0},
               {"iteration": 2, "elapsed_s": 75.0, "wall_time": 2075.0},
               {"iteration": 3, "elapsed_s": 100.0, "wall_time": 2100.0}]  # fmt: skip
    assert version_clock(records) == {0: (0.0, 0.0), 1: (68.0, 68.0), 2: (143.0, 143.0), 3: (168.0, 168.0)}
    # records without wall_time (older runs): elapsed_s going back is the only sign
    old = [{k: v for k, v in r.items() if k != "wall_time"} for r in records]
    assert version_clock(old)[3] == (100.0, 100.0)


def test_an_out_that_holds_a_run_or_a_model_is_not_written_over(tmp_path, scripted, capsys, folder_model):
    run = tmp_path / "run"
    (run / "tapes").mkdir(parents=True)
    (run / "tapes" / "iter_000001.jsonl").write_text("")
    (run / "state.json").write_text("{}")
    for out, named in ((run, "state.json"), (folder_model, "model.safetensors")):
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        code, _, err = run_eval("smollm2", "--tasks", 2, "--out", out, "--no-progress", capsys=capsys)
        line = err.strip().splitlines()[-1]
        assert code == 2 and line.startswith("error: --out:") and named in line, line
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert scripted["policies"] == []
