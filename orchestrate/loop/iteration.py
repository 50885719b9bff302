"""One RL run: the loop that ties servers, agents, tapes and the trainer together.

Each iteration i, the README's six steps (`generate`, then `catch_up` and `complete`):
  1. rollouts: the next episode seeds of the train split (the same ones on a resumed run: they depend on the
     iteration and the run seed only) played on the policy servers -> tapes with per-turn rewards; with
     rollouts.dynamic_sampling, groups without signal are dropped and extra seeds played in rounds
     (orchestrate.loop.dynamic_sampling)
  2. reference pass (orchestrate.loop.servers; skipped when no KL term needs it: kl_coef 0, ppo.kl_in_reward 0)
     over the tapes of the batch; a LoRA run scores it on the policy servers' base model (no adapter); with
     --teacher.model the teacher scores the same tapes in this pass
  3. the tapes are saved, then the training samples (batches/i, orchestrate.loop.samples)
  4. the trainer (a separate accelerate process, alive for the whole run) writes checkpoints/i
  5. the policy servers get the new weights, no restart (orchestrate.loop.servers, orchestrate.serving.weights)
  6. every `eval.every` iterations: held-out episodes (orchestrate.loop.evaluation); with eval.overlap
     (config_checks.overlap_eval) they play after the next iteration's batch is handed over, while the
     trainer trains it, on the weights served since step 5 (the next ones are served after)
and then its record (orchestrate.loop.report): metrics line, plot, state.json: the iteration is complete.

With run.max_minutes the loop starts no new iteration once that many minutes have passed since the command
started (elapsed_s of the metrics): the batches already generated are trained and recorded, as at the end of
run.iterations, and the run ends; the same command resumes it, with a new budget.

Steps whose files already exist are not redone, so a run killed at any point
resumes where it stopped and completed iterations stay as they were.

phase.json in the run directory names the step the loop is in (contract.rundir.LOOP_PHASES:
rollouts, reference, samples, training, weight_reload, eval, metrics_state); bench/bench_kill.py kills the
loop inside each of them, with the test hook orchestrate.loop.phase.kill_hook.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

from agents.agent import TRAINED_BINDINGS, Agent
from agents.env_spec import EnvSpec
from contract.rundir import RunDir
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import overlap_eval
from orchestrate.loop.counterfactual import counterfactual_metrics, run_counterfactuals
from orchestrate.loop.dynamic_sampling import dropped, dynamic_metrics, iteration_seeds, sample_dynamically
from orchestrate.loop.evaluation import Evaluation, play_tasks
from orchestrate.loop.metrics import rollout_metrics
from orchestrate.loop.phase import PHASE_LOCK, kill_hook
from orchestrate.loop.policy import RunModels
from orchestrate.loop.report import Reporter, Timer, busy_fractions
from orchestrate.loop.rollouts import EnvClock, RolloutContext, run_rollouts
from orchestrate.loop.samples import save_tapes, write_samples
from orchestrate.loop.servers import Servers
from orchestrate.loop.setup import RunSetup, interrupting_signals
from orchestrate.loop.trainer import TrainerProcess
from orchestrate.loop.trees import diverged, run_tree_rollouts, tree_metrics
from tapes.store import read_tapes
from tapes.tape import Tape


class Loop:
    def __init__(self, config: RLConfig, run_dir: RunDir, progress: bool = True, models: RunModels | None = None):
        self.config = config
        self.run = run_dir
        self.progress = progress
        self.models = models  # the model folders the run's checks resolved (orchestrate.loop.policy.RunModels)
        self.use_reference = config.train.needs_reference
        self.reporter = Reporter(config, run_dir, self.elapsed_s)
        # the run's parts, made by _start: the model folders, tokenizer, agent, train split, evaluation,
        # servers and trainer
        self.policy_dir = self.reference_dir = self.tokenizer = None
        self.agent: Agent | None = None
        self.train_env: EnvSpec | None = None
        self.evaluation: Evaluation | None = None
        self.servers: Servers | None = None
        self.trainer: TrainerProcess | None = None
        # this command's: its start, the iterations generated and not yet recorded, the phase times
        self.started = time.time()
        self.generated: dict[int, list[Tape]] = {}  # iterations whose batch is written and record is not
        self.timer = Timer()
        self.phase: tuple | None = None  # (iteration, phase, since) of phase.json
        self.deferred: int | None = None  # an iteration served whose evaluation waits for the next batch

    def _enter(self, iteration: int, phase: str) -> None:
        """The loop is now in `phase` of `iteration`: phase.json says so (and the test hook may fire)."""
        with PHASE_LOCK:
            self.phase = None  # a kill pending for the phase left no longer fires
        self.run.write_phase(iteration, phase)
        self.phase = token = (iteration, phase, time.monotonic())
        kill_hook(phase, still_in=lambda: self.phase is token)

    # -- set-up ------------------------------------------------------------------

    def _start(self, stack: ExitStack) -> None:
        """The run's parts, from its config (orchestrate.loop.setup): the agent, the servers (ours are
        started here; those given by URL run elsewhere) and the learner, started and serving the version it
        resumes at."""
        setup = RunSetup(self.config, self.run, self.models, progress=self.progress)
        self.policy_dir, self.reference_dir, self.tokenizer = setup.policy_dir, setup.reference_dir, setup.tokenizer
        self.train_env = EnvSpec.from_config(self.config, "train")
        self.evaluation = Evaluation(self.config, self.run)
        self.agent = setup.agent(stack)
        self.servers, self.trainer = setup.start(stack)

    # -- episodes --------------------------------------------------------------------

    async def _rollouts(
        self, spec, seeds, attempts, iteration, sampling, desc, follow=False, tree=None
    ) -> tuple[list[Tape], float, float]:
        """Tapes (chains; with `tree`, a TreeSection, trees); the seconds spent inside the environment (its
        reset and step: the 'reward' phase); the seconds calls were held back by weight swaps (with `follow`,
        new checkpoints are served meanwhile)."""
        clock = EnvClock()
        served = self.servers.served
        async with self.servers.client("policy", policy_version=served) as client:
            stop = asyncio.Event()
            watcher = asyncio.create_task(self.servers.follow(client, stop)) if follow else None
            context = RolloutContext(self.agent, spec, client, iteration, served, sampling, clock)
            try:
                if tree is not None:  # roots, then forks of them (orchestrate.loop.trees)
                    tapes = await run_tree_rollouts(context, seeds, attempts, tree, desc=desc, progress=self.progress)
                else:
                    tapes = await run_rollouts(context, seeds, attempts, desc=desc, progress=self.progress)
                if self.config.rollouts.counterfactual:  # forks at later roles' first calls
                    tapes += await run_counterfactuals(context, tapes, self.config.rollouts.counterfactual,
                                                       self.config.credited_roles, progress=self.progress,
                                                       desc=desc.replace("rollouts", "counterfactual forks"))  # fmt: skip
            finally:
                stop.set()
                if watcher is not None:
                    await watcher
                self.servers.count(client)
        # a frozen role's calls (the base's, a model's) are version 0; a role's own adapter's have the policy's
        frozen = {r for r, b in self.config.agent.roles.items() if b not in TRAINED_BINDINGS}
        for tape in tapes:  # a tape's version is its oldest call's: the one that bounds its lag
            versions = [call.policy_version for call in tape.llm_calls if call.role not in frozen]
            if versions:
                tape.metadata.policy_version = min(versions)
        return tapes, clock.wall_s, client.held_s

    # -- one iteration: its batch, then (when its checkpoint is served) its record -----

    def generate(self, i: int) -> None:
        """Iteration i's tapes and training samples (batches/i); a resumed run reuses the files it has."""
        c, timer = self.config, self.timer
        tape_file = self.run.iteration_tapes(i)
        if tape_file.exists():  # resumed after the tapes were saved: reuse them (and the versions on them)
            tapes = list(read_tapes(tape_file))
            if not self.run.batch(i).exists():
                self._enter(i, "samples")
        else:
            seeds, extra = iteration_seeds(i, c.rollouts)
            self._enter(i, "rollouts")
            done = 0  # rounds played (dynamic sampling plays extra ones)

            def rollout(round_seeds: list[int]) -> list[Tape]:
                nonlocal done
                desc = f"iteration {i} rollouts" + (f" (extra round {done})" if done else "")
                done += 1
                start = time.perf_counter()
                tapes, reward_seconds, held_seconds = asyncio.run(self._rollouts(
                    self.train_env, round_seeds, c.rollouts.attempts, i, None, desc, follow=c.run.async_level > 0,
                    tree=c.tree if c.tree.width else None,
                ))  # fmt: skip
                timer.add("generate", time.perf_counter() - start - reward_seconds - held_seconds)
                timer.add("reward", reward_seconds)
                timer.add("weight_sync", held_seconds)
                return tapes

            if c.rollouts.dynamic_sampling:
                tapes = sample_dynamically(rollout, seeds, extra, c.train).tapes
            else:
                tapes = rollout(seeds)
            if self.use_reference or c.teacher.model:  # the tapes trained on: not dropped groups', nor forks
                self._enter(i, "reference")  # that did not come back to their branch point
                start = time.perf_counter()
                self.servers.score_reference([t for t in tapes if not dropped(t) and not diverged(t)])
                timer.add("reference", time.perf_counter() - start)
            self._enter(i, "samples")  # the tapes, then the batch
            save_tapes(tape_file, tapes)
        if not self.run.batch(i).exists():
            batch = [t for t in tapes if not dropped(t)]  # the tapes marked dropped are saved, not trained on
            self._make_room()  # colocated: the learner trains as soon as the batch file is there
            write_samples(self.run.batch(i), batch, require_ref=self.use_reference)
        self.generated[i] = tapes

    def _make_room(self) -> None:
        """Colocated: the policy servers go to sleep before the learner trains (its time: weight_sync)."""
        start = time.perf_counter()
        self.servers.make_room()
        self.timer.add("weight_sync", time.perf_counter() - start)

    def catch_up(self, until: int, generated: int, defer: bool = False) -> None:
        """Complete iterations in order: through `until` (waiting for their checkpoints), then any later
        one up to `generated` whose checkpoint is already there (never waiting). With `defer` (eval.overlap),
        the last one, when its evaluation is due, is served and left for the next call: it is evaluated then,
        after the next batch is handed over, while the trainer trains it."""
        state = self.run.load_state()
        for j in range(state.completed_iteration + 1, generated + 1):
            if j == self.deferred:  # served already, and still (the next checkpoint is not served before it)
                self.deferred = None
                self.complete(j)
                continue
            if j > until and self.trainer.newest_checkpoint() < j:
                break
            self._enter(j, "training")
            self._make_room()  # a resumed run's batch may be there already
            start = time.perf_counter()
            self.trainer.wait_for_checkpoint(j, progress=self.progress, desc=f"iteration {j} train")
            self.timer.add("train", time.perf_counter() - start)
            start = time.perf_counter()
            self.servers.wake()  # colocated: back on the GPU the learner has given back, before the new weights
            self.timer.add("weight_sync", time.perf_counter() - start)
            newest = self.trainer.newest_checkpoint()
            if newest > self.servers.served:  # always the newest weights: with async_level 0 checkpoint j
                self._enter(j, "weight_reload")
                start = time.perf_counter()
                self.servers.serve(newest)
                self.timer.add("weight_sync", time.perf_counter() - start)
            if defer and j == generated and self.evaluation.due(j) and self.servers.served == j:
                self.deferred = j
                continue
            self.complete(j)

    def complete(self, j: int) -> None:
        """Iteration j's record (its checkpoint, or a newer one, is served): metrics line, evaluation when
        due, plot, state.json. Its time is the wall time since the previous record."""
        c = self.config
        tapes = self.generated.pop(j)
        # a counterfactual fork is another try at a role's turn, not another episode of a task
        record = {
            "iteration": j,
            **rollout_metrics([t for t in tapes if not diverged(t) and not t.metadata.counterfactual]),
        }
        if c.tree.width:
            record.update(tree_metrics(tapes))
        if c.rollouts.counterfactual:
            record.update(counterfactual_metrics(tapes))
        if c.rollouts.dynamic_sampling:
            record.update(dynamic_metrics(tapes, c.rollouts.tasks_per_iteration, c.train))
        record.update(self.trainer.iteration_metrics(j))
        if self.evaluation.due(j):
            self._enter(j, "eval")
            start = time.perf_counter()
            record.update(self.evaluate(j))
            self.timer.add("eval", time.perf_counter() - start)
        self._enter(j, "metrics_state")
        record.update(self.servers.take_metrics())
        record.update(self.timer.record())
        record.update(busy_fractions(record))
        self.timer = Timer()
        self.reporter.write(record)
        state = self.run.load_state()
        state.completed_iteration = j
        if "eval_success_rate" in record:
            state.evaluated.append(j)
        self.run.save_state(state)  # the iteration is complete
        self.run.prune_checkpoints(c.run.keep_checkpoints, protect={self.run.checkpoint(self.servers.served)})
        self.reporter.show(record)

    def evaluate(self, i: int) -> dict:
        """The held-out metrics of the weights served after iteration i (orchestrate.loop.evaluation)."""

        def play(spec, seeds, samples, iteration, sampling, desc) -> list[Tape]:
            async def go() -> list[Tape]:  # the code orchestrate.eval plays with, on the policy servers
                served = self.servers.served
                async with self.servers.client("policy", policy_version=served) as client:
                    try:
                        context = RolloutContext(self.agent, spec, client, iteration, served, sampling)
                        return await play_tasks(context, seeds, samples, desc=desc, progress=self.progress)
                    finally:
                        self.servers.count(client)

            return asyncio.run(go())

        return self.evaluation(i, play)

    # -- the run -----------------------------------------------------------------------

    def elapsed_s(self, now: float | None = None) -> float:
        """Seconds since this command started: metrics' elapsed_s, and the clock of run.max_minutes."""
        return (time.time() if now is None else now) - self.started

    def out_of_time(self) -> bool:
        """run.max_minutes have passed since this command started: start no new iteration."""
        limit = self.config.run.max_minutes
        return limit is not None and self.elapsed_s() >= 60 * limit

    def __call__(self) -> int:
        c = self.config
        state = self.run.load_state()
        if state.completed_iteration >= c.run.iterations:
            print(f"{self.run.root}: all {c.run.iterations} iterations are done (raise --iterations to go on).")
            return 0
        self.started = time.time()

        with ExitStack() as stack:
            stack.enter_context(interrupting_signals())
            self.reporter.open()
            stack.callback(self.reporter.close)
            self._enter(state.completed_iteration, "starting")
            self._start(stack)
            if self.evaluation.due(0) and state.completed_iteration == 0 and 0 not in state.evaluated:
                self._enter(0, "eval")
                start = time.perf_counter()
                record = {"iteration": 0, **self.evaluate(0), "time_eval": round(time.perf_counter() - start, 3)}
                self._enter(0, "metrics_state")
                self.reporter.write(record)
                state.evaluated.append(0)
                self.run.save_state(state)
                self.reporter.show(record)
            # Iteration i's batch is generated by a policy version >= i - 1 - async_level: after writing
            # batch i, wait for checkpoint i - async_level (async_level 0: checkpoint i, the synchronous loop).
            # Out of time (run.max_minutes), no new batch is generated; those generated (async_level ahead)
            # are trained and recorded as at run.iterations' end. Each command completes at least one.
            self.timer = Timer()  # iteration 1's wall time starts here, not at the servers' start
            first, last = state.completed_iteration + 1, c.run.iterations
            for i in range(first, c.run.iterations + 1):
                if i > first and self.out_of_time():
                    last = i - 1
                    break
                self.generate(i)
                self.catch_up(until=i - c.run.async_level, generated=i, defer=overlap_eval(c))
            self.catch_up(until=last, generated=last)
            self._enter(last, "done")
        if last < c.run.iterations:
            print(f"Stopped at the time limit (--run.max_minutes {c.run.max_minutes:g}) after iteration {last} of "
                  f"{c.run.iterations}, {self.elapsed_s() / 60:.1f} minutes after the start; the same command "
                  f"resumes it.", flush=True)  # fmt: skip
        return 0
