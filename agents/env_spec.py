"""Which environment, with which tools, for which split of which run (`EnvSpec`): enough to build it again
for a replay, and to send a tape's recorded actions to a fresh one (`rescore_episode`).

The spec is what a tape's `context["env"]` records; `EnvSpec.of(tape)` reads it back.
"""

from __future__ import annotations

from typing import Any

from agents.agent import summarize
from agents.envs import entry, make_env
from tapes.tape import Tape


class EnvSpec:
    """Which environment (and tools), for which split of which run: enough to build it again for a replay."""

    def __init__(
        self,
        env_id: str,
        options: dict[str, Any] | None,
        split: str,
        run_seed: int,
        tools: list[str] | None = None,
        sandbox: dict[str, Any] | None = None,
        search: dict[str, Any] | None = None,
    ):
        self.env_id, self.options, self.split, self.run_seed = env_id, dict(options or {}), split, run_seed
        self.tools = list(tools or [])
        self.sandbox_options = dict(sandbox or {})
        self.search_options = dict(search or {})
        self._sandbox = None  # one per spec: its slots bound the concurrent runs of model-written code
        self._retriever = None  # one per spec (and per process for an unchanged corpus: agents.search)

    @classmethod
    def from_config(cls, config, split: str) -> EnvSpec:
        """The run's environment for `split` (an RLConfig)."""
        e = config.env
        return cls(
            e.id,
            e.options,
            split,
            config.run.seed,
            e.tools,
            e.sandbox.model_dump(exclude_defaults=True),
            e.search.model_dump(exclude_defaults=True),
        )

    @property
    def uses_sandbox(self) -> bool:
        """Model-written code runs here: through the python tool, or in the environment itself (e.g. `code`)."""
        from agents.tools import TOOLS

        return any(TOOLS[t].runs_code for t in self.tools if t in TOOLS) or entry(self.env_id).sandbox

    def sandbox(self):
        """The spec's one Sandbox, built from its sandbox options (`--env.sandbox.*`) on first use."""
        if self._sandbox is None:
            from agents.sandbox import Sandbox, SandboxConfig

            self._sandbox = Sandbox(SandboxConfig(**self.sandbox_options))
        return self._sandbox

    def context(self, seed: int) -> dict[str, Any]:
        env = {"id": self.env_id, "options": self.options, "split": self.split, "run_seed": self.run_seed, "seed": seed}
        if self.tools:
            env["tools"] = self.tools
        if self.uses_sandbox:
            env["sandbox"] = self.sandbox_options
        if "search" in self.tools:
            env["search"] = self.search_options
        return {"env": env}

    def make(self, recorded: Tape | None = None, live_after: bool = False):
        """A fresh environment, wrapped with its tools; with `recorded`, the tools that a replay does not run
        again (search) answer from that tape's results, and with `live_after` (a fork: `recorded` is the part
        it replays) they answer the calls after those themselves."""
        sandbox = self.sandbox() if entry(self.env_id).sandbox else None
        env = make_env(self.env_id, self.options, split=self.split, run_seed=self.run_seed, sandbox=sandbox)
        if not self.tools:
            return env
        from agents.tools import TOOLS, RecordedTool, ToolEnv

        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown} (known: {', '.join(TOOLS)})")
        tools = [TOOLS[t].for_spec(self, load=recorded is None or live_after) for t in self.tools]
        if recorded is not None:
            tools = [RecordedTool(t, recorded, live_after) if t.answered_from_tape else t for t in tools]
        return ToolEnv(env, tools)

    @classmethod
    def of(cls, tape: Tape) -> tuple[EnvSpec, int]:
        """The spec and episode seed a tape was played with."""
        try:
            env = tape.context["env"]
            spec = cls(
                env["id"],
                env.get("options"),
                env["split"],
                env["run_seed"],
                env.get("tools"),
                env.get("sandbox"),
                env.get("search"),
            )
            return spec, int(env["seed"])
        except (TypeError, KeyError) as exc:
            raise ValueError(f"tape {tape.metadata.id} has no context.env.{exc}: not an environment episode") from None


def rescore_episode(tape: Tape) -> Tape:
    """Send the tape's recorded actions to a fresh environment from its seed and put the rewards, end
    flags and infos it gives now on the tape's observation steps (the LLM calls stay as recorded)."""
    from agents.envs.base import jsonable
    from agents.program import played_by_program
    from tapes.tape import EnvAction, EnvObservation

    if played_by_program(tape):
        raise ValueError(f"tape {tape.metadata.id} was played by an agent program: its steps are not actions the "
                         "environment answered one by one; score it with a reward function of the tape")  # fmt: skip
    spec, seed = EnvSpec.of(tape)
    env = spec.make(recorded=tape)
    env.reset(seed=seed)
    answers = {s.turn: s for s in tape.steps if isinstance(s, EnvObservation) and s.turn > 0}
    for action in [s for s in tape.steps if isinstance(s, EnvAction)]:
        step = answers.get(action.turn)
        if step is None or step.info.get("reason", "").startswith("truncated: output cut"):
            break  # the environment was never asked about a cut output
        _, reward, terminated, truncated, info = env.step(action.text)
        step.reward, step.terminated, step.info = float(reward), bool(terminated), jsonable(info)
        step.truncated = bool(truncated) or step.truncated
        if terminated or truncated:
            break
    return summarize(tape)
