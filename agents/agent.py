"""The agent: talks with an environment until the episode ends; one episode is one tape.

Turn 1: the environment's first observation becomes the user message (after an
optional system prompt and worked examples as earlier chat turns, and with the
configured instruction appended). Each turn the agent samples one output, sends
its whole text to `env.step` as the action, and records the environment's
answer, reward and end flags on the tape. The episode ends when the
environment says terminated or truncated, after `max_turns`, when an output
is cut by max_tokens (truncated, reward `truncation_reward`, the environment
is not asked), or when the next prompt would not fit the context (truncated).

Prompts after the first are built token-exactly (`agents.chat.ChatTokens`):
prompt ids of turn t+1 = prompt ids of turn t + the ids sampled at turn t +
the rendered delta of the new observation. Each call records whether its
prompt extends the previous prompt + output (`LLMCall.extends_previous`).

Exceptions from the environment (or from this code) are infrastructure
failures: the tape keeps them in `metadata.error` and is left out of
training; server failures (`LLMError`) propagate and stop the rollouts.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agents.chat import ChatTokens
from agents.envs.base import Env, capabilities, jsonable
from tapes.tape import (
    EnvAction,
    EnvObservation,
    LLMCall,
    SamplingParams,
    Tape,
    ToolCallAction,
    ToolResultObservation,
)


class TokenLLM(Protocol):
    """What the agent needs of an LLM: complete a prompt given as token ids (VLLMClient, ReplayLLM)."""

    async def complete_ids(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_text: str = "",
    ) -> LLMCall: ...


class Example(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(description="what the user said (an observation)")
    solution: str = Field(description="what the assistant answered (e.g. ending in \\boxed{answer})")


ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
OWN_ADAPTER = "adapter"  # the binding of a role with a LoRA adapter of its own (not a weight-transfer mechanism)
ROLE_BINDINGS = {
    "policy": "the run's policy, its weights shared by the roles bound to it",
    "base": "the initial policy, frozen: on a LoRA run the servers' base model, without the adapter",
    OWN_ADAPTER: "a LoRA adapter of the role's own on the same base, trained on its samples alone (a LoRA run)",
}
TRAINED_BINDINGS = ("policy", OWN_ADAPTER)  # the bindings whose roles the run trains (the others are frozen)
MODEL_BINDING = ("a model, frozen, on a server of its own: a model name ('smollm2'), a model folder, a run directory "
                 "(its newest checkpoint) or a vLLM server's URL; its tokenizer must be the policy's")  # fmt: skip


def model_bindings(roles: dict[str, str]) -> dict[str, str]:
    """The roles bound to a model of their own (a name, folder, run directory or URL; not a keyword of
    ROLE_BINDINGS): role -> that model, as given."""
    return {role: binding for role, binding in roles.items() if binding not in ROLE_BINDINGS}


def example_turns(examples: list[Example]) -> list[dict[str, Any]]:
    """Worked examples as earlier chat turns: user, assistant, user, ..."""
    turns: list[dict[str, Any]] = []
    for example in examples:
        turns += [{"role": "user", "content": example.question}, {"role": "assistant", "content": example.solution}]
    return turns


class AgentConfig(BaseModel):
    """How the agent frames the conversation."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str | None = Field(None, description="system message; none keeps the chat template's default")
    instruction: str = Field("", description="appended (on a new line) to the environment's first observation")
    examples: list[Example] = Field(
        default_factory=list,
        description="worked examples as earlier chat turns (user, assistant, user, ...); "
        "several in a row read as one multi-turn example",
    )
    max_turns: int = Field(
        16,
        gt=0,
        le=1000,
        description="agent turns per episode at most (the environment may "
        "end it sooner); reaching it truncates the episode",
    )
    truncation_reward: float = Field(
        -1.0,
        allow_inf_nan=False,
        description="reward of a turn whose output was cut by max_tokens; the episode "
        "ends there, truncated, without asking the environment",
    )
    program: str | None = Field(
        None,
        description="an agent program of your own, MODULE:CALLABLE (async def play(task, client)): it plays each "
        "episode through an OpenAI-compatible gateway, recorded as tapes (docs/programs.md), with the options of "
        "the program section; none: the built-in agent (system_prompt, instruction, examples and max_turns are "
        "the built-in agent's)",
    )

    command: str | None = Field(
        None,
        description="a CLI agent harness run as a command for each episode (Codex, mini-swe-agent, a script of "
        "yours; docs/programs.md#harnesses-as-commands), in a fresh workspace, its model server the episode's "
        "gateway; {prompt} {model} {base_url} {workspace} are replaced, the prompt on stdin without {prompt}; "
        "the options of the program section; none: no harness",
    )

    roles: dict[str, str] = Field(
        default_factory=dict,
        description="several agents in one episode: each role's name and what it is bound to, as JSON, e.g. "
        '{"solver": "policy", "judge": "policy"}; an agent program or harness picks a role by the `model` name it '
        "sends (docs/programs.md#roles). `policy`: the run's policy, its weights shared by the roles, each role's "
        "calls credited as an episode of its own (its turns' returns, its own advantage groups); `base`: the "
        "initial policy, frozen, never trained (a LoRA run's base model); `adapter`: a LoRA adapter of the role's "
        "own, trained on its samples alone (a LoRA run); anything else is a model, frozen, served on a server of its "
        "own (a model name, folder, run directory or a vLLM server's URL; the policy's tokenizer). Empty: one agent, "
        "the `model` name 'policy'",
    )
    role_examples: dict[str, list[Example]] = Field(
        default_factory=dict,
        description="the multi-agent agent's worked examples, per role (an agent of the environment): each "
        "role's first call shows its own as earlier chat turns, after the system prompt",
    )

    @field_validator("roles")
    @classmethod
    def _bound(cls, value: dict[str, str]) -> dict[str, str]:
        for name, binding in value.items():
            if not ROLE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a role name: letters, digits, '_', '.' and '-', the `model` name "
                                 "a program sends")  # fmt: skip
            if not binding.strip():
                raise ValueError(f"{name}: bound to nothing; bind it to 'policy' (the run's policy)")
            if binding != binding.strip():
                raise ValueError(f"{name}: {binding!r} has spaces around it; one of: "
                                 + ", ".join(f"{b} ({why})" for b, why in ROLE_BINDINGS.items())
                                 + f", or {MODEL_BINDING}")  # fmt: skip
        return value

    @field_validator("program")
    @classmethod
    def _loads(cls, value: str | None) -> str | None:
        if value is not None:
            from agents.program import load_program

            load_program(value)  # ProgramError (a ValueError): refused before anything starts
        return value

    @field_validator("command")
    @classmethod
    def _runs(cls, value: str | None) -> str | None:
        if value is not None:
            from agents.harness import check_command

            check_command(value)  # HarnessError (a ValueError): not found, refused before anything starts
        return value

    @model_validator(mode="after")
    def _one_program(self) -> AgentConfig:
        if self.program is not None and self.command is not None:
            raise ValueError("agent.program and agent.command: give one of them (a harness command is a program)")
        return self

    def first_messages(self, observation: str) -> list[dict[str, Any]]:
        """The built-in agent's first prompt: the system prompt, the worked examples as earlier turns, then the
        task with the instruction."""
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages += example_turns(self.examples)
        text = f"{observation}\n{self.instruction}" if self.instruction else observation
        messages.append({"role": "user", "content": text})
        return messages

    @property
    def plays_program(self) -> bool:
        """Does a program of the user's (a function, or a harness command) play the episodes?"""
        return self.program is not None or self.command is not None


class RoleLLMs:
    """Which LLM answers each role of an episode (agent.roles: role -> binding): for a role bound to `base`, `llm`'s
    base model (`llm.base_model()`), for one bound to `adapter`, the role's own adapter (`llm.role_model(role)`),
    for one bound to a model, that model's server (`llm.model_of(binding)`), each made once; else `llm`. An LLM
    without them (a replay) answers every role itself (from its tape)."""

    def __init__(self, llm: TokenLLM, bindings: Any = None):
        self.llm, self.bindings = llm, dict(bindings or {})
        self._made: dict[str, Any] = {}

    def __call__(self, role: str | None) -> Any:
        binding = self.bindings.get(role)
        if binding == "base" and hasattr(self.llm, "base_model"):
            if role not in self._made:
                self._made[role] = self.llm.base_model()
            return self._made[role]
        if binding == OWN_ADAPTER and hasattr(self.llm, "role_model"):
            if role not in self._made:
                self._made[role] = self.llm.role_model(role)
            return self._made[role]
        if binding is not None and binding not in ROLE_BINDINGS and hasattr(self.llm, "model_of"):
            if role not in self._made:
                self._made[role] = self.llm.model_of(binding)
            return self._made[role]
        return self.llm


class Agent:
    """What plays episodes: the built-in agent (ChatAgent) or an agent program (orchestrate.gateway.agent's
    ProgramAgent). Started before its first episode and closed after its last (`with agent:` does both; start
    and close are no-ops unless the agent holds something, as a program's gateway); `run_episode` plays one."""

    name = "agent"

    def start(self) -> None:
        pass

    async def run_episode(
        self, env: Env, seed: int, llm: TokenLLM, tape: Tape, sampling: SamplingParams | None = None
    ) -> Tape:
        """Play one episode of `env` from `seed`, its calls answered by `llm`, extending `tape`; returns it."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChatAgent(Agent):
    """The built-in agent: relays the environment's observations to the model, one turn per call."""

    name = "chat_agent"

    def __init__(self, config: AgentConfig, sampling: SamplingParams, chat: ChatTokens, max_context: int | None = None):
        self.config = config
        self.sampling = sampling
        self.chat = chat
        self.max_context = max_context  # the server's max_model_len: prompt + max_tokens must fit

    def first_messages(self, observation: str) -> list[dict[str, Any]]:
        return self.config.first_messages(observation)

    def _record(self, tape: Tape, step, call: LLMCall | None = None) -> None:
        step.metadata.agent = self.name
        step.metadata.node = "act" if call is not None else "env"
        tape.append(step, llm_call=call)

    async def run_episode(
        self, env: Env, seed: int, llm: TokenLLM, tape: Tape, sampling: SamplingParams | None = None
    ) -> Tape:
        """Play one episode of `env` from `seed`, extending `tape`; returns it."""
        sampling = sampling or self.sampling
        can = capabilities(env)
        if can.agents:
            raise ValueError(f"the environment has several agents ({', '.join(can.agents)}): bind each as a role "
                             "(--agent.roles) for the multi-agent agent to play them")  # fmt: skip
        env_stop = [s for s in can.stop if s not in sampling.stop]
        if env_stop:  # an environment with tools: sampling stops at the end of a tool call
            sampling = sampling.model_copy(update={"stop": [*sampling.stop, *env_stop]})
        tape.metadata.author = self.name
        observation, info = env.reset(seed=seed)
        self._record(tape, EnvObservation(text=str(observation), turn=0, info=jsonable(info)))
        messages = self.first_messages(str(observation))
        prompt_text, prompt_ids = self.chat.first_prompt(messages)
        previous: list[int] | None = None
        for turn in range(1, self.config.max_turns + 1):
            if self.max_context and len(prompt_ids) + sampling.max_tokens > self.max_context:
                last = tape.steps[-1]
                last.truncated = True  # the conversation no longer fits the model's context
                last.info["reason"] = (
                    f"context full: {len(prompt_ids)} prompt tokens + {sampling.max_tokens} new "
                    f"> max_model_len {self.max_context}"
                )
                break
            call = await llm.complete_ids(prompt_ids, sampling, messages=list(messages), prompt_text=prompt_text)
            call.turn = turn
            if previous is not None:
                ids = call.prompt_token_ids
                call.extends_previous = len(ids) > len(previous) and ids[: len(previous)] == previous
            # an environment with tools reads the call it will run
            parsed = env.tool_call(call.output_text) if can.tool_calls else None
            action = (
                EnvAction(text=call.output_text, turn=turn)
                if parsed is None
                else ToolCallAction(text=call.output_text, turn=turn, tool=parsed.tool, call=parsed.text)
            )
            self._record(tape, action, call)
            if call.finish_reason == "length":
                self._record(tape, EnvObservation(
                    text="", turn=turn, reward=self.config.truncation_reward, truncated=True,
                    info={"reason": "truncated: output cut by max_tokens", "success": False},
                ))  # fmt: skip
                break
            # an environment whose step blocks (a tool run) offers astep
            observation, reward, terminated, truncated, info = (
                await env.astep(call.output_text) if can.async_step else env.step(call.output_text)
            )
            info = jsonable(info)
            if turn == self.config.max_turns and not (terminated or truncated):
                truncated = True
                info.setdefault("reason", f"turn limit ({self.config.max_turns}) reached")
            fields = dict(
                text=str(observation),
                turn=turn,
                reward=float(reward),
                terminated=bool(terminated),
                truncated=bool(truncated),
                info=info,
            )
            tool = info.get("tool") if parsed is not None else None
            self._record(tape, EnvObservation(**fields) if tool is None else ToolResultObservation(**fields, tool=tool))
            if terminated or truncated:
                break
            previous = call.prompt_token_ids + call.output_token_ids
            delta_text, delta_ids = self.chat.continuation(call.output_token_ids, str(observation))
            messages += [
                {"role": "assistant", "content": call.output_text},
                {"role": "user", "content": str(observation)},
            ]
            prompt_text += self.chat.tokenizer.decode(call.output_token_ids, skip_special_tokens=False) + delta_text
            prompt_ids = previous + delta_ids
        summarize(tape)
        return tape


def summarize(tape: Tape) -> Tape:
    """Fill the tape's reward (sum over turns), success, turns and end flags from its steps."""
    observations = [s for s in tape.steps if isinstance(s, EnvObservation)]
    rewards = [s.reward for s in observations if s.reward is not None]
    last = observations[-1] if observations else None
    m = tape.metadata
    m.turns = len({s.turn for s in tape.steps if isinstance(s, EnvAction)})  # a turn may hold several tool calls
    m.reward = float(sum(rewards)) if rewards else None
    m.terminated = bool(last and last.terminated)
    m.truncated = bool(last and last.truncated)
    # the environment's latest verdict, even when rewards came after it (a program's task.reward for a role)
    judged = next((s.info["success"] for s in reversed(observations) if isinstance(s.info.get("success"), bool)), None)
    m.success = judged if judged is not None else bool(rewards) and rewards[-1] > 0
    m.reward_reason = str(last.info.get("reason", "")) if last is not None else ""
    return tape


def role_rewards(tape: Tape) -> dict[str, float]:
    """Each role's reward, the sum of its turns' (a turn is its call's role's), in order of the roles' first
    calls; empty for an episode of one agent (agent.roles)."""
    roles: dict[int, str] = {c.turn: c.role for c in tape.llm_calls if c.role is not None}
    out = dict.fromkeys(dict.fromkeys(roles.values()), 0.0)
    for turn, reward in enumerate(turn_rewards(tape), start=1):
        if turn in roles:
            out[roles[turn]] += reward
    return out


def turn_rewards(tape: Tape) -> list[float]:
    """The reward of each agent turn, in order (a turn's reward is on the observation that answers it)."""
    by_turn: dict[int, float] = {}
    for s in tape.steps:
        if isinstance(s, EnvObservation) and s.turn > 0 and s.reward is not None:
            by_turn[s.turn] = by_turn.get(s.turn, 0.0) + s.reward
    return [float(by_turn.get(t, 0.0)) for t in range(1, tape.metadata.turns + 1)]
