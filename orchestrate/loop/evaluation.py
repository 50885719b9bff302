"""Held-out evaluation: before the first iteration and every `eval.every` iterations, the test split's first
episodes (`eval.tasks`, else the environment's whole test set) played once each at `eval.temperature`, their
tapes saved as RUN/tapes/eval_NNNNNN.jsonl and summarised as the `eval_*` metrics."""

from __future__ import annotations

from collections.abc import Callable

from agents.env_spec import EnvSpec
from agents.envs import capabilities
from contract.rundir import RunDir
from orchestrate.loop.config import RLConfig
from orchestrate.loop.metrics import rollout_metrics
from orchestrate.loop.samples import save_tapes
from tapes.store import read_tapes
from tapes.tape import SamplingParams, Tape

# play(spec, seeds, attempts, iteration, sampling, desc) -> the tapes (the loop's rollouts on the policy servers)
Play = Callable[[EnvSpec, list[int], int, int, SamplingParams, str], list[Tape]]


def eval_size(config: RLConfig) -> int:
    """Held-out episodes per evaluation: eval.tasks, else the environment's whole test set (500 if unbounded)."""
    if config.eval.tasks is not None:
        return config.eval.tasks
    size = capabilities(EnvSpec.from_config(config, "test").make()).test_size
    return size if size is not None else 500


class Evaluation:
    def __init__(self, config: RLConfig, run_dir: RunDir):
        self.every = config.eval.every
        self.run = run_dir
        self.spec = EnvSpec.from_config(config, "test")
        self.episodes = eval_size(config)
        self.sampling = SamplingParams(temperature=config.eval.temperature, max_tokens=config.eval.max_tokens)

    def due(self, iteration: int) -> bool:
        """Whether the iteration is evaluated (0: before training)."""
        return bool(self.every) and iteration % self.every == 0

    def __call__(self, iteration: int, play: Play) -> dict:
        """The eval_* metrics of the weights served after `iteration`; a resumed run reuses saved tapes."""
        path = self.run.eval_tapes(iteration)
        if path.exists():
            tapes = list(read_tapes(path))
        else:
            tapes = play(self.spec, list(range(self.episodes)), 1, iteration, self.sampling, f"eval after {iteration}")
            save_tapes(path, tapes)
        return rollout_metrics(tapes, prefix="eval_")
