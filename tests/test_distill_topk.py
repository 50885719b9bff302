"""The teacher's top-k (--teacher.topk): its k most likely tokens scored at every sampled position, carried on
the tapes and in the samples, and the learner's cross-entropy to them (the head's gradient against autograd's,
the student moving toward the teacher), with the refusals."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from contract.batch import Sample
from finetune.config import TrainConfig
from finetune.logprobs import PolicyLogProbs, soft_logprobs
from finetune.microbatch import micro_batches
from finetune.step import teacher_top
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.reference import annotate_reference
from orchestrate.loop.samples import SampleError, tape_samples
from orchestrate.serving.llm import LLMError, Scores, VLLMClient
from tapes.tape import LLMCall
from tests.test_agents import Endpoint
from tests.test_distill import config_refused
from tests.test_episodes import play

# -- the learner's head ----------------------------------------------------------------------------


def test_soft_logprobs_and_their_gradient_equal_a_full_log_softmax():
    torch.manual_seed(0)
    hidden = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (9,))
    ids = torch.randint(0, 40, (9, 5))
    q = torch.softmax(torch.randn(9, 5, dtype=torch.float64), -1)

    full = torch.log_softmax(hidden @ weight.T, -1)
    expected = full.gather(1, ids)
    (-(q * expected).sum()).backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    raw_logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)
    got = soft_logprobs(hidden, weight, targets, raw_logp, ids, chunk=4)  # chunks smaller than the rows
    (-(q * got).sum()).backward()
    assert torch.allclose(got, expected, atol=1e-10)
    assert torch.allclose(hidden.grad, want[0], atol=1e-10) and torch.allclose(weight.grad, want[1], atol=1e-10)


def test_the_fused_and_full_heads_give_the_same_top_k_log_probs_and_gradients(tmp_path):
    from finetune.tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny")
    prompts, completions = [[3, 4, 5], [3, 4, 5, 6]], [[7, 8, 9], [10, 11]]
    ids = torch.tensor([[7, 1, 2], [8, 3, 9], [9, 0, 5], [10, 12, 13], [11, 7, 8]])
    q = torch.softmax(torch.randn(5, 3), -1)
    results = {}
    for impl in ("fused", "full"):
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        policy = PolicyLogProbs(lm, impl, chunk=2)
        (mb,) = micro_batches(prompts, completions, 64, "padded")
        order = torch.cat([torch.arange(0, 3) if i == 0 else torch.arange(3, 5) for i in mb.indices])
        out = policy(mb.input_ids, mb.position_ids, mb.rows, mb.cols, mb.targets,
                     torch.full((5,), 1 / 0.7), soft_ids=ids[order])  # fmt: skip
        assert out.raw_logp is None and out.soft_logp.shape == (5, 3)
        (-(q[order] * out.soft_logp).sum()).backward()
        results[impl] = out.soft_logp.detach(), [p.grad.clone() for p in lm.parameters() if p.grad is not None]
    (fused, fused_grads), (full, full_grads) = results["fused"], results["full"]
    assert torch.allclose(fused, full, atol=1e-5)
    assert len(fused_grads) == len(full_grads) > 0
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fused_grads, full_grads))


def test_teacher_top_renormalises_the_teachers_k_and_pads_narrower_rows():
    s = Sample(prompt_ids=[1], completion_ids=[5, 6], behaviour_logprobs=[-1.0, -1.0], reward=0.0, group_id="g",
               teacher_top_ids=[[5, 7], [6, 8]], teacher_top_logprobs=[[-0.1, -2.5], [-1.0, -1.0]])  # fmt: skip
    one = Sample(prompt_ids=[1], completion_ids=[9], behaviour_logprobs=[-1.0], reward=0.0, group_id="g",
                 teacher_top_ids=[[9]], teacher_top_logprobs=[[-0.3]])  # fmt: skip
    top = teacher_top([s, one])
    assert top.ids.tolist() == [[5, 7], [6, 8], [9, 9]]
    p = math.exp(-0.1) / (math.exp(-0.1) + math.exp(-2.5))
    assert top.q[0].tolist() == pytest.approx([p, 1 - p]) and top.q[1].tolist() == pytest.approx([0.5, 0.5])
    assert top.q[2].tolist() == [1.0, 0.0]  # the padding has no weight
    assert top.neg_entropy.tolist() == pytest.approx([p * math.log(p) + (1 - p) * math.log(1 - p), math.log(0.5), 0])


def top_samples(learner, k: int = 3):
    """Two samples whose teacher puts most of its weight on tokens the student finds unlikely."""
    samples = [Sample(prompt_ids=[40, 41, 42], completion_ids=c, behaviour_logprobs=[0.0] * len(c), reward=0.0,
                      group_id="g") for c in ([10, 11, 12], [20, 21])]  # fmt: skip
    now = learner.logprobs(samples)
    out = []
    for s, lp in zip(samples, now):
        rows = [[100 + j, 101 + j, 102 + j][:k] for j in range(len(s.completion_ids))]
        lps = [[-0.2, -2.0, -3.0][:k] for _ in rows]
        out.append(s.model_copy(update={"behaviour_logprobs": lp.tolist(), "teacher_top_ids": rows,
                                        "teacher_top_logprobs": lps}))  # fmt: skip
    return out


def test_the_learner_moves_the_student_toward_the_teachers_top_k(tmp_path):
    """Top-k distillation alone on a tiny model (no advantage: estimator zero, teacher_coef 0): the student's
    log-probs of the teacher's favourite tokens rise, and the KL to the teacher's top-k it reports falls."""
    from finetune.learner import Learner
    from finetune.tiny_model import make_tiny_model

    learner = Learner(make_tiny_model(tmp_path / "tiny"), TrainConfig(lr=1e-2, estimator="zero", teacher_topk_coef=1.0))
    batch = top_samples(learner)
    favourite = [s.model_copy(update={"completion_ids": [100 + j for j in range(len(s.completion_ids))]})
                 for s in batch]  # fmt: skip
    before = learner.logprobs(favourite)
    (first,) = learner.train_batch(batch)
    (second,) = learner.train_batch(batch)
    after = learner.logprobs(favourite)
    assert all(a.sum() > b.sum() for a, b in zip(after, before)), (before, after)
    assert 0 < second["teacher_topk_kl"] < first["teacher_topk_kl"]
    assert "teacher_kl" not in first  # the advantage term is off


def test_top_k_ids_are_bounded_by_the_heads_rows_not_the_configs_vocabulary(tmp_path, monkeypatch):
    """A model whose config names more tokens than its head has rows (padded vocabularies): the learner bounds
    the teacher's ids by the head, so an id between the two is left out of q instead of indexing past the head."""
    from finetune import models
    from finetune.learner import Learner
    from finetune.tiny_model import make_tiny_model

    real = models._language_model

    def config_says_more(*args, **kwargs):
        lm, lora = real(*args, **kwargs)
        lm.config.vocab_size += 7
        return lm, lora

    monkeypatch.setattr(models, "_language_model", config_says_more)
    learner = Learner(make_tiny_model(tmp_path / "tiny"), TrainConfig(estimator="zero", teacher_topk_coef=1.0))
    rows = learner.models.model.lm.get_output_embeddings().weight.shape[0]
    assert learner.models.vocab_size == rows
    batch = top_samples(learner)
    first = batch[0].teacher_top_ids
    batch[0] = batch[0].model_copy(update={"teacher_top_ids": [first[0][:2] + [rows + 3]] + first[1:]})
    (stats,) = learner.train_batch(batch)  # the id past the head is left out; the rest train
    assert math.isfinite(stats["teacher_topk_kl"])


def test_the_learner_refuses_samples_without_the_top_k(tmp_path):
    from finetune.learner import Learner
    from finetune.tiny_model import make_tiny_model

    learner = Learner(make_tiny_model(tmp_path / "tiny"), TrainConfig(estimator="zero", teacher_topk_coef=1.0))
    batch = top_samples(learner)
    batch[1] = batch[1].model_copy(update={"teacher_top_ids": None, "teacher_top_logprobs": None})
    with pytest.raises(ValueError, match="1 of 2 samples have no teacher top-k"):
        learner.train_batch(batch)


# -- scoring and the tapes -------------------------------------------------------------------------


def entry(rank, logprob):
    return {"logprob": logprob, "rank": rank, "decoded_token": "x"}


def client_answering(entries):
    """A client whose server answers every request with these prompt log-probs; `sent`: the requests' bodies."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries}]})

    return VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler)), sent


def test_score_top_keeps_the_k_most_likely_in_rank_order_beside_the_sent_token():
    # position 2 sent token 9 (rank 5, outside the top 2); position 3 sent token 4 (rank 1, in it)
    entries = [None, {"1": entry(1, -0.1)}, {"9": entry(5, -4.0), "3": entry(2, -1.5), "7": entry(1, -0.5)},
               {"4": entry(1, -0.2), "8": entry(2, -2.0)}]  # fmt: skip
    client, sent = client_answering(entries)
    scores = asyncio.run(client.score_top([0, 1, 9, 4], 2, 2))
    assert sent[0]["prompt_logprobs"] == 2 and sent[0]["echo"] is True
    assert scores == Scores([-4.0, -0.2], [[7, 3], [4, 8]], [[-0.5, -1.5], [-0.2, -2.0]])
    assert asyncio.run(client.score([0, 1, 9, 4], 2)) == [-4.0, -0.2]
    assert sent[1]["prompt_logprobs"] == 0


def test_score_top_refuses_fewer_than_k():
    client, _ = client_answering([None, {"5": entry(1, -0.1)}, {"6": entry(1, -0.3)}])
    with pytest.raises(LLMError, match="1 of the top 2 log-probs at 1"):
        asyncio.run(client.score_top([0, 5, 6], 1, 2))


class TopScorer:
    """Scores token i as -i/10; its top 2 at position i: (1000 + i, 2000 + i) with log-probs -0.1, -0.2."""

    async def score(self, ids, start):
        raise AssertionError("a top-k pass asks score_top")

    async def score_top(self, ids, start, k):
        rows = range(start, len(ids))
        return Scores([-i / 10 for i in rows], [[1000 + i, 2000 + i][:k] for i in rows], [[-0.1, -0.2][:k]
                      for _ in rows])  # fmt: skip


def test_the_teacher_pass_with_top_fills_each_output_tokens_rows(tokenizer):
    tape, _, _ = play(tokenizer, [("too low", 0.0, False), ("yes", 1.0, True)], ["\\boxed{5}", "\\boxed{7}"])
    assert asyncio.run(annotate_reference([tape], TopScorer(), False, "teacher_logprobs", top=2)) == 2
    for call in tape.llm_calls:
        start = len(call.prompt_token_ids)
        positions = range(start, start + len(call.output_token_ids))
        assert call.teacher_logprobs == [-i / 10 for i in positions]
        assert call.teacher_top_ids == [[1000 + i, 2000 + i] for i in positions]
        assert call.teacher_top_logprobs == [[-0.1, -0.2]] * len(call.output_token_ids)
    back = LLMCall.model_validate_json(tape.llm_calls[0].model_dump_json())
    assert back.teacher_top_ids == tape.llm_calls[0].teacher_top_ids

    # the samples carry them, every turn's, in the order of the trained tokens
    tape.metadata.group_id = "g"
    (raw,) = tape_samples(tape, require_ref=False)
    sample = Sample.model_validate(json.loads(json.dumps(raw)))
    first, second = tape.llm_calls
    assert sample.teacher_top_ids == first.teacher_top_ids + second.teacher_top_ids
    second.teacher_top_logprobs = second.teacher_top_logprobs[1:]
    with pytest.raises(SampleError, match="the teacher's top-k misaligned"):
        tape_samples(tape, require_ref=False)
    second.teacher_top_ids = second.teacher_top_logprobs = None  # one call without: the sample has none
    (raw,) = tape_samples(tape, require_ref=False)
    assert raw["teacher_top_ids"] is None and raw["teacher_top_logprobs"] is None


def test_only_the_teachers_pass_asks_for_the_top_k(tmp_path, monkeypatch):
    from contextlib import asynccontextmanager

    from contract.rundir import RunDir
    from orchestrate.loop import servers
    from orchestrate.loop.servers import Servers
    from tests.test_colocation import Recorded

    calls = []
    config = RLConfig.model_validate({"teacher": {"model": "smollm2", "topk": 5}, "train": {"kl_coef": 0.1}})
    group = Servers(config, RunDir(tmp_path), None, [Recorded("policy", calls)], Recorded("reference", calls),
                    teacher=Recorded("teacher", calls))  # fmt: skip

    @asynccontextmanager
    async def client(role):
        yield role

    async def scored(tapes, client, progress, field, top=0):
        calls.append((client, field, top))

    monkeypatch.setattr(group, "client", client)
    monkeypatch.setattr(servers, "annotate_reference", scored)
    group.score_reference([])
    assert [c for c in calls if len(c) == 3] == [("reference", "ref_logprobs", 0), ("teacher", "teacher_logprobs", 5)]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"teacher_top_logprobs": None}, ["come together"]),
        ({"teacher_top_ids": [[5, 7]]}, ["1 and 2 rows for 2 sampled tokens"]),
        ({"teacher_top_ids": [[5, 7], [6]]}, ["rows differ in length"]),
        ({"teacher_top_ids": [[], []], "teacher_top_logprobs": [[], []]}, ["k > 0"]),
        ({"teacher_top_logprobs": [[-0.1, float("nan")], [-1.0, -1.0]]}, ["finite"]),
    ],
)
def test_a_bad_top_k_is_refused_by_the_batch_format(change, words):
    good = {"prompt_ids": [1], "completion_ids": [5, 6], "behaviour_logprobs": [-1.0, -1.0], "reward": 0.0,
            "group_id": "g", "teacher_top_ids": [[5, 7], [6, 8]], "teacher_top_logprobs": [[-0.1, -2.5], [-1.0, -1.0]]}  # fmt: skip
    Sample.model_validate(good)
    with pytest.raises(ValueError) as exc:
        Sample.model_validate({**good, **change})
    assert all(w in str(exc.value) for w in words), str(exc.value)


# -- options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"teacher.topk": "4"}, ["--teacher.topk 4", "--teacher.model"]),
        ({"teacher.coef": "0.5"}, ["--teacher.coef 0.5", "no teacher", "--teacher.model"]),  # was ignored
        ({"teacher.topk_coef": "2"}, ["--teacher.topk_coef 2.0", "no teacher"]),
        ({"teacher.model": "smollm2", "teacher.topk": "21"}, ["--teacher.topk", "20"]),
        ({"teacher.model": "smollm2", "teacher.topk": "-1"}, ["--teacher.topk", "0"]),
        ({"teacher.model": "smollm2", "teacher.topk": "4", "teacher.topk_coef": "0"}, ["--teacher.topk_coef"]),
        (
            {"teacher.model": "smollm2", "teacher.topk": "4", "teacher.topk_coef": "nan"},
            ["--teacher.topk_coef", "finite"],
        ),
        ({"teacher.model": "smollm2", "teacher.coef": "0"}, ["--teacher.coef 0", "--teacher.topk"]),
        ({"train.teacher_topk_coef": "1"}, ["--train.teacher_topk_coef", "--teacher.topk_coef"]),
    ],
)
def test_bad_top_k_options_are_refused_in_one_line(overrides, words):
    config_refused(overrides, words)


def test_the_learner_gets_the_top_k_coef_and_coef_0_means_the_top_k_alone():
    c = resolve("embedded", {"teacher.model": "smollm2", "teacher.topk": "20", "teacher.coef": "0",
                             "teacher.topk_coef": "0.5", "train.estimator": "zero"})  # fmt: skip
    assert (c.teacher_coef, c.teacher_topk_coef, c.train.teacher_topk_coef) == (0.0, 0.5, 0.0)  # set at the start
    assert resolve("embedded", {"teacher.model": "smollm2"}).teacher_topk_coef == 0.0  # no topk: no term


def test_offline_top_k_distillation_needs_the_top_k_on_every_call(tokenizer):
    from orchestrate.after.offline import check_teacher_logprobs

    tape, _, _ = play(tokenizer, [("yes", 1.0, True)], ["\\boxed{7}"])
    (call,) = tape.llm_calls
    call.teacher_logprobs = [-0.5] * len(call.output_token_ids)
    assert check_teacher_logprobs([tape], TrainConfig(teacher_coef=1.0)) == [tape]
    with pytest.raises(ConfigError, match=r"^--train.teacher_topk_coef: 1 LLM calls have no teacher top-k"):
        check_teacher_logprobs([tape], TrainConfig(teacher_coef=1.0, teacher_topk_coef=1.0))
    call.teacher_top_ids = [[1]] * len(call.output_token_ids)
    call.teacher_top_logprobs = [[-0.1]] * len(call.output_token_ids)
    assert check_teacher_logprobs([tape], TrainConfig(teacher_topk_coef=1.0)) == [tape]


def test_the_browser_shows_the_teachers_most_likely_tokens(tmp_path, tokenizer):
    from orchestrate.after.browse import SHOWN_TOP, RunIndex
    from orchestrate.loop.samples import save_tapes

    tape, _, _ = play(tokenizer, [("yes", 1.0, True)], ["\\boxed{7}"])
    (call,) = tape.llm_calls
    n = len(call.output_token_ids)
    hello = tokenizer.encode("hello")[0]
    call.teacher_top_ids = [[hello, 1, 2, 3, 4]] * n
    call.teacher_top_logprobs = [[-0.1, -2.0, -3.0, -4.0, -5.0]] * n
    save_tapes(tmp_path / "run" / "tapes" / "iter_000001.jsonl", [tape])
    (shown,) = RunIndex(tmp_path / "run").tape("iter_000001.jsonl", 0)["calls"]
    top = shown["tokens"][0]["teacher_top"]
    # a run directory without a model: tokens shown by id, as the sampled ones are
    assert len(top) == SHOWN_TOP and top[0] == [f"⟨{hello}⟩", -0.1] and top[1] == ["⟨1⟩", -2.0]
    assert "teacher_top_ids" not in shown and "teacher_top_logprobs" not in shown


# -- a real server ---------------------------------------------------------------------------------


@pytest.mark.vllm
def test_a_real_server_gives_the_top_k_of_each_position(reference_server, tokenizer):
    """vLLM's prompt log-probs with k: k entries per position, most likely first, the sent token's log-prob
    among them when it is in the top k, and the top-1 log-prob at least the sent token's."""
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")

    async def go():
        async with VLLMClient([reference_server], tokenizer) as client:
            return await client.score_top(ids, 1, 5), await client.score(ids, 1)

    top, plain = asyncio.run(go())
    assert top.logprobs == pytest.approx(plain, abs=1e-4)
    assert len(top.top_ids) == len(top.top_logprobs) == len(ids) - 1
    assert all(len(row) == 5 and row == sorted(row, reverse=True) for row in top.top_logprobs)
    for sent, lp, row_ids, row_lps in zip(ids[1:], top.logprobs, top.top_ids, top.top_logprobs):
        assert row_lps[0] >= lp - 1e-4
        if sent in row_ids:
            assert row_lps[row_ids.index(sent)] == pytest.approx(lp, abs=1e-4)
    assert sum(sent in row for sent, row in zip(ids[1:], top.top_ids)) >= len(ids) // 3  # a real model's text


@pytest.mark.vllm
def test_a_run_distils_from_the_teachers_top_k_end_to_end(tiny_model_dir, tiny_policy_server, tmp_path):
    """The whole path on real parts: the run's own teacher server (the tiny model's folder) scores the top 3 of
    every sampled token in the reference pass, the tapes and the batch carry them, the accelerate-launched
    trainer trains on them alone (--teacher.coef 0) and reports the KL to them."""
    import subprocess
    import sys

    from contract.batch import read_batch
    from orchestrate.loop.metrics import read_metrics
    from tapes.store import read_tapes
    from tests.conftest import lend

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--iterations", "1",
           "--model.policy", str(tiny_model_dir), "--teacher.model", str(tiny_model_dir),
           "--teacher.topk", "3", "--teacher.coef", "0", "--train.estimator", "zero",
           "--rollouts.temperature", "1.0", "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "2",
           "--rollouts.max_tokens", "8", "--eval.every", "0", "--server.max_model_len", "512",
           "--server.kv_cache_gib", "1", "--train.token_budget", "1024",
           *lend([tiny_policy_server], tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tapes = list(read_tapes(run / "tapes" / "iter_000001.jsonl"))
    calls = [c for t in tapes for c in t.llm_calls if c.output_token_ids]
    assert len(tapes) == 4 and calls
    for call in calls:
        assert len(call.teacher_top_ids) == len(call.teacher_top_logprobs) == len(call.output_token_ids)
        assert all(len(row) == 3 and row == sorted(row, reverse=True) for row in call.teacher_top_logprobs)
    samples = read_batch(run / "batches" / "000001.jsonl")
    assert all(s.teacher_top_ids is not None and len(s.teacher_top_ids) == s.n_trained for s in samples)
    (record,) = read_metrics(run / "metrics.jsonl")
    assert 0 < record["train_teacher_topk_kl"] < math.inf and "train_teacher_kl" not in record
    assert (run / "checkpoints" / "000001" / "config.json").is_file()
