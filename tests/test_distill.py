"""On-policy distillation: a teacher's log-probs on the tapes and in the samples, its per-token advantage
worked out by hand, the learner training on it, and the refusals before a run starts."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from contract.batch import Sample, Turn
from finetune.batch_advantages import batch_advantages
from finetune.config import TrainConfig
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.preflight import PreflightError
from orchestrate.loop.reference import annotate_reference
from orchestrate.loop.samples import tape_samples
from tapes.tape import LLMCall, Tape
from tests.test_episodes import play
from tests.test_server_pool import fake_server  # noqa: F401 - a fixture: a server by URL that answers as ours

# -- the signal, by hand --------------------------------------------------------------------------

# A: one turn of 2 tokens. B: two turns of 2 sampled tokens with 3 environment tokens between them.
A = Sample(prompt_ids=[1, 2], completion_ids=[5, 6], behaviour_logprobs=[-1.0, -2.0],
           teacher_logprobs=[-0.5, -3.0], reward=1.0, group_id="g", episode_id="a")  # fmt: skip
B = Sample(prompt_ids=[1, 2], completion_ids=[7, 2, 198, 1, 55, 9, 2],
           turns=[Turn(index=0, start=0, length=2, reward=0.0), Turn(index=1, start=5, length=2, reward=0.0)],
           behaviour_logprobs=[-0.2, -0.4, -1.0, -0.1], teacher_logprobs=[-0.2, -0.1, -2.0, -0.1],
           reward=0.0, group_id="g", episode_id="b")  # fmt: skip


def advantages(estimator: str, coef: float):
    cfg = TrainConfig(estimator=estimator, normalize_std=False, teacher_coef=coef)
    adv = batch_advantages([A, B], cfg, None, lambda samples: [])
    return [a.tolist() for a in adv.per_token], adv.stats


def test_pure_distillation_gives_each_sampled_token_coef_times_teacher_minus_behaviour():
    # reverse KL per token (behaviour - teacher): A [-0.5, 1.0], B [0.0, -0.3, 1.0, 0.0]; x -0.5
    per_token, stats = advantages("zero", 0.5)
    assert per_token[0] == pytest.approx([0.25, -0.5])
    assert per_token[1] == pytest.approx([0.0, 0.15, -0.5, 0.0])  # the model's own tokens only, every turn
    assert stats["teacher_kl"] == pytest.approx((-0.5 + 1.0 + 0.0 - 0.3 + 1.0 + 0.0) / 6)
    assert stats["teacher_adv_share"] == pytest.approx(1.0)


def test_the_teachers_term_is_added_to_the_rewards_advantage():
    # group baseline without std: G_0 of A is 1, of B 0, mean 0.5 -> A +0.5 on its tokens, B -0.5 on all of its
    per_token, stats = advantages("group", 0.5)
    assert per_token[0] == pytest.approx([0.75, 0.0])
    assert per_token[1] == pytest.approx([-0.5, -0.35, -1.0, -0.5])
    teacher, reward = 0.25 + 0.5 + 0.15 + 0.5, 0.5 * 2 + 0.5 * 4
    assert stats["teacher_adv_share"] == pytest.approx(teacher / (teacher + reward))


def test_without_teacher_coef_nothing_changes_and_no_figures():
    per_token, stats = advantages("group", 0.0)
    assert per_token[0] == pytest.approx([0.5, 0.5]) and "teacher_kl" not in stats


def test_samples_without_teacher_logprobs_are_refused_by_the_learner():
    cfg = TrainConfig(estimator="zero", teacher_coef=1.0)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        batch_advantages([A, B.model_copy(update={"teacher_logprobs": None})], cfg, None, lambda s: [])


def test_a_misaligned_teacher_list_is_refused_by_the_batch_format():
    with pytest.raises(ValueError, match="teacher_logprobs has 1 values for 2"):
        Sample.model_validate({**A.model_dump(), "teacher_logprobs": [-1.0]})


def test_the_learner_raises_the_tokens_the_teacher_prefers(tmp_path):
    """Pure distillation on a tiny model: where the teacher gives a token more than the student sampled it
    with, its log-prob rises; where less, it falls. The figures reach the step's metrics."""
    from finetune.learner import Learner
    from finetune.tiny_model import make_tiny_model

    learner = Learner(make_tiny_model(tmp_path / "tiny"), TrainConfig(lr=1e-2, estimator="zero", teacher_coef=1.0))
    samples = [Sample(prompt_ids=[40, 41, 42], completion_ids=c, behaviour_logprobs=[0.0] * len(c), reward=0.0,
                      group_id="g") for c in ([10, 11, 12], [20, 21])]  # fmt: skip
    now = learner.logprobs(samples)
    batch = [s.model_copy(update={"behaviour_logprobs": lp.tolist(), "teacher_logprobs": (lp + shift).tolist()})
             for s, lp, shift in zip(samples, now, (1.0, -1.0))]  # fmt: skip
    (m,) = learner.train_batch(batch)
    after = learner.logprobs(batch)
    assert after[0].sum() > now[0].sum() and after[1].sum() < now[1].sum(), (now, after)
    assert m["teacher_kl"] == pytest.approx((3 * -1.0 + 2 * 1.0) / 5, abs=1e-5)
    assert m["teacher_adv_share"] == 1.0


# -- tapes and samples -----------------------------------------------------------------------------


def test_tape_json_round_trip_keeps_teacher_logprobs_and_older_tapes_read_without_them():
    call = LLMCall(output_token_ids=[1, 2], logprobs=[-0.1, -0.2], teacher_logprobs=[-0.3, -0.4])
    back = LLMCall.model_validate_json(call.model_dump_json())
    assert back.teacher_logprobs == [-0.3, -0.4] and back == call
    older = json.loads(call.model_dump_json())
    del older["teacher_logprobs"]
    assert LLMCall.model_validate(older).teacher_logprobs is None
    tape = Tape()
    assert Tape.model_validate_json(tape.model_dump_json()) == tape


def test_an_episodes_sample_carries_the_teacher_logprobs_of_every_turn(tokenizer):
    tape, _, _ = play(tokenizer, [("too low", 0.0, False), ("yes", 1.0, True)], ["\\boxed{5}", "\\boxed{7}"])
    tape.metadata.group_id = "g"
    first, second = tape.llm_calls
    (raw,) = tape_samples(tape, require_ref=False)
    assert raw["teacher_logprobs"] is None  # not scored by a teacher
    first.teacher_logprobs = [-1.0 - i for i in range(len(first.output_token_ids))]
    (raw,) = tape_samples(tape, require_ref=False)
    assert raw["teacher_logprobs"] is None  # one call scored, not the other: none (the learner refuses)
    second.teacher_logprobs = [-0.5] * len(second.output_token_ids)
    (raw,) = tape_samples(tape, require_ref=False)
    sample = Sample.model_validate(json.loads(json.dumps(raw)))  # as the learner reads it
    assert sample.teacher_logprobs == first.teacher_logprobs + second.teacher_logprobs


class FakeScorer:
    """Scores token i of ids as -i/10 (what a server's echo + prompt_logprobs would give from `start`)."""

    def __init__(self):
        self.requests = []

    async def score(self, ids, start):
        self.requests.append((list(ids), start))
        return [-i / 10 for i in range(start, len(ids))]


def test_the_teacher_pass_fills_teacher_logprobs_and_leaves_the_reference_alone(tokenizer):
    tape, _, _ = play(tokenizer, [("too low", 0.0, False), ("yes", 1.0, True)], ["\\boxed{5}", "\\boxed{7}"])
    scorer = FakeScorer()
    assert asyncio.run(annotate_reference([tape], scorer, progress=False, field="teacher_logprobs")) == 2
    assert len(scorer.requests) == 1  # the episode's turns in one request
    for call in tape.llm_calls:
        start = len(call.prompt_token_ids)
        assert call.teacher_logprobs == [-i / 10 for i in range(start, start + len(call.output_token_ids))]
        assert call.ref_logprobs is None


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"teacher.model": "smollm2", "teacher.coef": "nan"}, ["--teacher.coef", "finite"]),
        ({"teacher.model": "smollm2", "teacher.coef": "inf"}, ["--teacher.coef", "finite"]),
        ({"teacher.model": "smollm2", "teacher.coef": "-1"}, ["--teacher.coef", "greater than or equal to 0"]),
        ({"train.estimator": "zero"}, ["--train.estimator zero", "--teacher.model"]),
        ({"train.teacher_coef": "1"}, ["--train.teacher_coef", "--teacher.coef"]),
        ({"teacher.model": "http://node7:8000/v1"}, ["--teacher.model", "not a server URL"]),
    ],
)
def test_bad_distillation_options_are_refused_in_one_line(overrides, words):
    config_refused(overrides, words)


def config_refused(overrides: dict, words: list[str]) -> None:
    """The embedded preset with `overrides` is refused in one line that holds every one of `words`."""
    with pytest.raises(ConfigError) as exc:
        resolve("embedded", overrides)
    line = str(exc.value)
    assert "\n" not in line and all(w in line for w in words), line


def test_one_attempt_per_task_is_allowed_with_a_teacher():
    """Groups of one give the group baseline nothing, but the teacher's term still trains every token."""
    assert resolve("embedded", {"rollouts.attempts": "1", "teacher.model": "smollm2"}).rollouts.attempts == 1
    with pytest.raises(ConfigError, match="^--rollouts.attempts: 1 attempt per task"):
        resolve("embedded", {"rollouts.attempts": "1"})


def test_the_learner_gets_the_teacher_coef_and_a_url_is_a_served_teacher():
    c = resolve("embedded", {"teacher.model": "smollm2", "teacher.coef": "0.25", "train.estimator": "zero"})
    assert c.teacher_coef == 0.25 and c.train.teacher_coef == 0.0 and c.teacher.url is None  # set at the start
    assert resolve("embedded", {}).teacher_coef == 0.0
    assert resolve("embedded", {"teacher.model": "http://node7:8000/"}).teacher.url == "http://node7:8000"


def copy_model(src, dst, tokenizer: bool = True):
    shutil.copytree(src, dst, ignore=None if tokenizer else shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    return dst


def refused(rl_cli, tmp_path, student, teacher, words):
    run_dir = tmp_path / "run"
    code, line = rl_cli(["--run-dir", run_dir, "--model.policy", student, "--teacher.model", teacher])
    assert code == 2, line
    assert all(w in line for w in words), line
    assert not run_dir.exists()


def test_a_teacher_that_does_not_exist_is_refused(tmp_path, rl_cli, tiny_model_dir):
    refused(rl_cli, tmp_path, tiny_model_dir, tmp_path / "gone", ["--teacher.model"])


def test_a_teacher_without_a_tokenizer_is_refused(tmp_path, rl_cli, tiny_model_dir):
    teacher = copy_model(tiny_model_dir, tmp_path / "teacher", tokenizer=False)
    refused(rl_cli, tmp_path, tiny_model_dir, teacher, ["--teacher.model", "tokenizer"])


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, rl_cli, tiny_model_dir):
    from transformers import AutoTokenizer

    teacher = copy_model(tiny_model_dir, tmp_path / "teacher")
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(teacher)
    refused(
        rl_cli, tmp_path, tiny_model_dir, teacher, ["--teacher.model", "vocabulary", str(teacher), str(tiny_model_dir)]
    )
    # the same vocabulary, another chat template
    teacher = copy_model(tiny_model_dir, tmp_path / "teacher2")
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(teacher)
    refused(rl_cli, tmp_path, tiny_model_dir, teacher, ["--teacher.model", "chat template", str(tiny_model_dir)])


def test_a_teacher_whose_template_differs_only_in_text_passes_with_a_note(tmp_path, tiny_model_dir, capsys):
    """Llama-3.1-8B teaching Llama-3.2-1B: one vocabulary, templates that differ in the system header's text
    only. The teacher scores the student's rendering, so the run may go; a note says so."""
    from transformers import AutoTokenizer

    from orchestrate.loop.preflight import chat_markup, check_teacher
    from tests.conftest import TINY_CHAT_TEMPLATE

    teacher = copy_model(tiny_model_dir, tmp_path / "teacher")
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.chat_template = "Cutting Knowledge Date: December 2023\n" + TINY_CHAT_TEMPLATE
    tok.save_pretrained(teacher)
    student_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.chat_template != student_tok.chat_template
    assert (
        chat_markup(tok, "t") == chat_markup(student_tok, "s") == ["<s>", "</s>", "<s>", "</s>", "<s>", "</s>", "<s>"]
    )
    assert check_teacher(str(teacher), tiny_model_dir, "student") == teacher
    assert "differs from the student's in its text" in capsys.readouterr().err
    # another markup: one turn marker fewer (no generation prompt's) is refused, both sequences named
    tok.chat_template = TINY_CHAT_TEMPLATE.replace("<s>assistant", "assistant")
    tok.save_pretrained(teacher)
    with pytest.raises(PreflightError, match="marks chat turns otherwise.*</s> <s> </s> against"):
        check_teacher(str(teacher), tiny_model_dir, "student")


def test_a_run_without_a_checkpoint_is_refused_as_a_teacher(tmp_path, rl_cli, tiny_model_dir):
    run = tmp_path / "teacher_run"
    run.mkdir()
    (run / "config.json").write_text(resolve("embedded", {"model.policy": str(tiny_model_dir)}).model_dump_json())
    refused(rl_cli, tmp_path, tiny_model_dir, run, ["--teacher.model", "no checkpoint"])


def test_the_teacher_scores_in_the_reference_pass_on_its_own_server_the_policy_asleep(tmp_path, monkeypatch):
    from contextlib import asynccontextmanager

    from contract.rundir import RunDir
    from orchestrate.loop import servers
    from orchestrate.loop.servers import Servers
    from tests.test_colocation import Recorded

    calls = []
    config = RLConfig.model_validate({"teacher": {"model": "smollm2"}, "train": {"kl_coef": 0.1}})
    group = Servers(config, RunDir(tmp_path), None, [Recorded("policy", calls)], Recorded("reference", calls),
                    teacher=Recorded("teacher", calls))  # fmt: skip

    @asynccontextmanager
    async def client(role):
        yield role

    async def scored(tapes, client, progress, field, top=0):
        calls.append((client, field))

    monkeypatch.setattr(group, "client", client)
    monkeypatch.setattr(servers, "annotate_reference", scored)
    group.score_reference([])
    assert calls == [("policy", "sleep"), ("reference", "wake"), ("reference", "ref_logprobs"),
                     ("reference", "sleep"), ("teacher", "wake"), ("teacher", "teacher_logprobs"),
                     ("teacher", "sleep"), ("policy", "wake")]  # fmt: skip
    # a LoRA run's reference on the policy servers' base model, the teacher on its own server
    calls.clear()
    group.reference = None
    group.score_reference([])
    assert calls == [("base", "ref_logprobs"), ("policy", "sleep"), ("teacher", "wake"),
                     ("teacher", "teacher_logprobs"), ("teacher", "sleep"), ("policy", "wake")]  # fmt: skip


@pytest.mark.parametrize("rank", [0, 8])
def test_a_run_with_a_teacher_builds_its_server_beside_the_others(tmp_path, tiny_model_dir, rank, monkeypatch):
    """A teacher by folder gets a server of its own (named teacher, its own log), with or without a reference
    server and with a LoRA student; a teacher by URL is used as it runs."""
    from contract.rundir import RunDir
    from orchestrate.loop.servers import Servers
    from orchestrate.serving.vllm_server import RemoteServer, VLLMServer

    model = str(tiny_model_dir)
    config = RLConfig.model_validate(
        {"model": {"policy": model}, "teacher": {"model": model}, "train": {"lora": {"rank": rank}}}
    )
    servers = Servers.for_run(config, RunDir(tmp_path / "run"), model, model, None, progress=False,
                              teacher_dir=tiny_model_dir)  # fmt: skip
    assert isinstance(servers.teacher, VLLMServer) and servers.teacher.served_model_name == "teacher"
    assert servers.teacher.log_path == tmp_path / "run" / "logs" / "teacher.log"
    assert servers.reference is None and servers.all == [*servers.policy, servers.teacher]  # no KL term
    config = RLConfig.model_validate({"model": {"policy": model}, "teacher": {"model": "http://node7:8000"},
                            "train": {"kl_coef": 0.01}})  # fmt: skip
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    servers = Servers.for_run(config, RunDir(tmp_path / "run2"), model, model, None, progress=False)
    assert isinstance(servers.teacher, RemoteServer) and servers.teacher.url == "http://node7:8000"
    assert servers.teacher.served_model_name == "teacher" and isinstance(servers.reference, VLLMServer)


def test_a_teacher_by_url_is_checked_before_the_run(tmp_path, monkeypatch, fake_server):  # noqa: F811
    from orchestrate.loop.preflight import PreflightError, check_remote_servers

    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    policy = fake_server()
    config = RLConfig.model_validate(
        {"server": {"policy_urls": [policy]}, "teacher": {"model": fake_server(model="teacher")}}
    )
    check_remote_servers(config, tmp_path / "run")
    config = RLConfig.model_validate(
        {"server": {"policy_urls": [policy]}, "teacher": {"model": fake_server(model="reference")}}
    )
    with pytest.raises(PreflightError, match=r"^--teacher.model: .*serves 'reference', not 'teacher'"):
        check_remote_servers(config, tmp_path / "run")


def test_the_teachers_folder_is_resolved_once_per_run(tmp_path, tiny_model_dir, monkeypatch):
    """The checks resolve the run's model folders (the teacher's: a run's newest checkpoint, say) and hand them
    to the set-up, which takes them as they are; a loop built without them resolves them itself."""
    from contract.rundir import RunDir
    from orchestrate.loop import policy, preflight
    from orchestrate.loop.setup import RunSetup

    config = RLConfig.model_validate(
        {"model": {"policy": str(tiny_model_dir)}, "teacher": {"model": str(tiny_model_dir)}}
    )
    calls = []
    resolve_teacher = policy.teacher_folder
    monkeypatch.setattr(policy, "teacher_folder", lambda *a: calls.append(a) or resolve_teacher(*a))
    monkeypatch.setattr(preflight, "teacher_folder", policy.teacher_folder)
    models = policy.RunModels.of(config, model=preflight.check_model,
                                 teacher=lambda name, p: preflight.check_teacher(name, p, config.model.policy))  # fmt: skip
    assert models == policy.RunModels(tiny_model_dir, tiny_model_dir, tiny_model_dir) and len(calls) == 1
    setup = RunSetup(config, RunDir(tmp_path), models)
    assert (setup.policy_dir, setup.teacher_dir) == (tiny_model_dir, tiny_model_dir) and len(calls) == 1
    assert RunSetup(config, RunDir(tmp_path)).teacher_dir == tiny_model_dir and len(calls) == 2
    by_url = RLConfig.model_validate({"model": {"policy": str(tiny_model_dir)}, "teacher": {"model": "http://x:1"}})
    assert RunSetup(by_url, RunDir(tmp_path)).teacher_dir is None and len(calls) == 2  # its server's folder


def test_the_serve_command_serves_a_teacher(tmp_path, tiny_model_dir):
    from orchestrate.serve import build_server

    config = RLConfig.model_validate(
        {"model": {"policy": str(tiny_model_dir)}, "teacher": {"model": str(tiny_model_dir)}}
    )
    command = build_server(config, "teacher", "0.0.0.0", 8123, tmp_path).command()
    assert command[command.index("--served-model-name") + 1] == "teacher"
    assert str(tiny_model_dir) in command


def test_a_colocated_teacher_counts_in_the_memory_plan_as_one_more_sleeping_server():
    """On one GPU the teacher's server sleeps through generation and training and is awake for its pass alone,
    as the reference server: each phase needs one SLEEPING_GIB more than without it."""
    from orchestrate.loop.memory_plan import SLEEPING_GIB, Shape, phases
    from tests.test_colocation import LLAMA_1B, gsm8k

    plain = gsm8k()  # a KL term: a reference server
    taught = plain.model_copy(update={"teacher": plain.teacher.model_copy(update={"model": "smollm2"})})
    before = phases(plain, Shape(**LLAMA_1B), 79.1, compiled=True, colocated=True)
    after = phases(taught, Shape(**LLAMA_1B), 79.1, compiled=True, colocated=True)
    assert {p: round(after[p] - before[p], 6) for p in before} == {p: SLEEPING_GIB for p in before}
    by_url = plain.model_copy(update={"teacher": plain.teacher.model_copy(update={"model": "http://node7:8000"})})
    assert phases(by_url, Shape(**LLAMA_1B), 79.1, compiled=True, colocated=True) == before


def test_the_browser_shows_each_tokens_teacher_log_prob(tmp_path, tokenizer):
    from orchestrate.after.browse import RunIndex
    from orchestrate.loop.samples import save_tapes

    tape, _, _ = play(tokenizer, [("too low", 0.0, False), ("yes", 1.0, True)], ["\\boxed{5}", "\\boxed{7}"])
    first, second = tape.llm_calls
    first.teacher_logprobs = [-0.5] * len(first.output_token_ids)
    save_tapes(tmp_path / "run" / "tapes" / "iter_000001.jsonl", [tape])
    body = RunIndex(tmp_path / "run").tape("iter_000001.jsonl", 0)
    shown, unscored = body["calls"]
    assert [t["teacher_logprob"] for t in shown["tokens"]] == first.teacher_logprobs
    assert all("teacher_logprob" not in t for t in unscored["tokens"]) and "teacher_logprobs" not in shown


def test_offline_distillation_needs_the_teachers_log_probs_on_every_call(tokenizer):
    from orchestrate.after.offline import check_teacher_logprobs

    tape, _, _ = play(tokenizer, [("too low", 0.0, False), ("yes", 1.0, True)], ["\\boxed{5}", "\\boxed{7}"])
    check_teacher_logprobs([tape], TrainConfig())  # no teacher term: nothing needed
    tape.llm_calls[0].teacher_logprobs = [-0.5] * len(tape.llm_calls[0].output_token_ids)
    with pytest.raises(ConfigError, match=r"^--train.teacher_coef: 1 LLM calls have no teacher log-probs"):
        check_teacher_logprobs([tape], TrainConfig(teacher_coef=1.0))
    tape.llm_calls[1].teacher_logprobs = [-0.5] * len(tape.llm_calls[1].output_token_ids)
    assert check_teacher_logprobs([tape], TrainConfig(teacher_coef=1.0)) == [tape]
    # a tape dynamic sampling left out of its run's batch was never scored: left out here too, said in a line
    from orchestrate.loop.dynamic_sampling import mark_dropped

    unscored, _, _ = play(tokenizer, [("yes", 1.0, True)], ["\\boxed{7}"])
    mark_dropped(unscored)
    assert check_teacher_logprobs([tape, unscored], TrainConfig(teacher_coef=1.0)) == [tape]


def test_offline_equal_rewards_are_kept_when_the_teacher_gives_the_signal():
    from orchestrate.after.offline import score_and_filter
    from tests.test_tapes import make_tape

    tapes = [make_tape(i) for i in range(4)]  # one group, every reward 1.0: the group baseline gives 0
    kept = score_and_filter(tapes, None, lambda t: True, "all", TrainConfig(teacher_coef=1.0), progress=False)
    assert kept == tapes


def test_the_teacher_note_names_a_tempered_rollout_or_tree():
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.preflight import teacher_temperature_note

    def note(**options):
        config = resolve("countdown", {k.replace("__", "."): v for k, v in options.items()})
        return config.model_copy(update={"teacher": config.teacher.model_copy(update={"model": "teacher"})})

    assert teacher_temperature_note(note()) is None  # countdown samples at 1.0
    assert "--rollouts.temperature 0.7" in teacher_temperature_note(note(rollouts__temperature="0.7"))
    assert "--tree.temperature 1.5" in teacher_temperature_note(note(tree__width="2", tree__temperature="1.5"))
    no_teacher = resolve("countdown", {"rollouts.temperature": "0.7"})
    assert teacher_temperature_note(no_teacher) is None


def test_generation_ahead_of_training_on_shared_cores_is_noted():
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.preflight import shared_cores_note

    assert shared_cores_note(resolve("embedded", {}), count=0) is None  # synchronous
    note = shared_cores_note(resolve("embedded", {"run.async_level": "1"}), count=0)
    assert "--run.async_level 1" in note and "--server.cpus" in note
    split = resolve("embedded", {"run.async_level": "1", "server.cpus": "0", "trainer.cpus": "1"})
    assert shared_cores_note(split, count=0) is None
    assert (
        shared_cores_note(resolve("embedded", {"run.async_level": "1"}), count=2) is None
    )  # on GPUs: no CPU cores to share
