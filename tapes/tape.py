"""The record: a Tape of typed Steps, and every LLM call that produced them.

The JSON shape follows TapeAgents (`metadata`, `context`, `steps`, each step
with `metadata` and a `kind` discriminator), so tools that read TapeAgents
tapes read ours. On top of that a tape keeps its LLM calls whole
(`llm_calls`): prompt messages and token ids, output text and token ids,
per-token log-probs, reference log-probs once annotated, sampling parameters
and the policy version. Training samples are cut from those calls, with the
token ids vLLM actually sampled (nothing is re-tokenized).

Step kinds are open: subclass `Step` (or `Observation` / `Thought` /
`Action`) with a `kind: Literal["..."]` field and the class registers itself;
`Tape.model_validate` turns each step dict back into its class by `kind` and
refuses a kind it does not know.

Every float is written back as it was read. JSON has no NaN or infinity, yet
a log-prob of -inf is legitimate vLLM output and a reward may be NaN, so
non-finite floats are written as the bare constants `NaN`, `Infinity` and
`-Infinity` (what Python's `json` module writes and reads, and what pydantic
reads); finite values keep the plain TapeAgents JSON. Strict JSON parsers
(JavaScript's `JSON.parse`, some `jq` builds) refuse those constants: read
tape files with Python's `json` or `Tape.model_validate_json`. Free-form
fields (`context`, `result`, `info`, `data`, `messages`, `other`) hold JSON
values only (dicts with string keys, lists, strings, numbers, booleans,
null): a tuple, set, bytes or object is refused when the model is built,
naming the field, because it would not come back as what went in.

Fields this version does not know, on the tape, its metadata, its LLM calls
(and their sampling parameters) and the steps' metadata, are kept and written
back (after the known ones); an unknown field of a step itself is refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, SerializeAsAny, field_validator


def new_id() -> str:
    return uuid.uuid4().hex


class TapeModel(BaseModel):
    """Base of every model written on a tape: NaN and +-inf are written as JSON's NaN/Infinity constants
    (not null), so they read back identical. A model nested in a tape must derive from it (pydantic applies
    this setting per model class)."""

    model_config = ConfigDict(ser_json_inf_nan="constants")


class OpenTapeModel(TapeModel):
    """A tape model that keeps the fields it does not know (written by a newer version, or by TapeAgents) and
    writes them back after its own, so reading and rewriting a file loses nothing. Steps do not: an unknown
    step field is refused, naming it."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JsonValue] = Field(init=False)  # JSON values only, as the free-form fields


class SamplingParams(OpenTapeModel):
    """How the completion was sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)


class VersionChange(OpenTapeModel):
    """New weights swapped in while a call was generating (`--run.in_flight_swaps`): output tokens from
    `token` on were sampled by `version`."""

    token: int = Field(ge=0, description="index in output_token_ids of the first token the new weights sampled")
    version: int = Field(ge=0, description="the policy version that sampled it and the tokens after it")


class LLMCall(OpenTapeModel):
    """One LLM call, kept whole: what went in, what came out, how, and from which weights."""

    id: str = Field(default_factory=new_id, description="referenced by StepMetadata.prompt_id")
    model: str = Field("", description="model name or folder that served the call")
    policy_version: int = Field(
        0, description="training iteration whose weights served the call (0 = initial); its first token's"
    )
    version_changes: list[VersionChange] = Field(
        default_factory=list, description="new weights that took over during the call, in order (none: one version)"
    )
    messages: list[dict[str, JsonValue]] = Field(default_factory=list, description="chat messages of the prompt")
    prompt_text: str = Field("", description="the prompt after the chat template")
    prompt_token_ids: list[int] = Field(default_factory=list)
    output_text: str = ""
    output_token_ids: list[int] = Field(default_factory=list, description="exactly the ids vLLM sampled")
    logprobs: list[float] = Field(
        default_factory=list, description="log-prob of each output token under the sampling distribution"
    )
    ref_logprobs: list[float] | None = Field(
        None, description="log-prob of each output token under the reference model, once annotated"
    )
    teacher_logprobs: list[float] | None = Field(
        None, description="log-prob of each output token under the teacher (--teacher.model), once annotated"
    )
    teacher_top_ids: list[list[int]] | None = Field(
        None,
        description="per output token, the teacher's k most likely next tokens there, most likely first "
        "(--teacher.topk), once annotated",
    )
    teacher_top_logprobs: list[list[float]] | None = Field(
        None, description="their log-probs under the teacher, row by row as teacher_top_ids"
    )
    finish_reason: str | None = Field(None, description="'stop', 'length' (cut by max_tokens), ...")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    created: float = Field(default_factory=time.time)
    latency_s: float | None = None
    turn: int = Field(1, description="the episode's turn this call acted in (1 = first)")
    extends_previous: bool | None = Field(
        None,
        description="whether prompt_token_ids are exactly the previous call's prompt + output ids followed "
        "by more tokens (None for the first call of an episode); False means the conversation was re-rendered",
    )
    protocol: str | None = Field(
        None,
        description="the API an agent program's call came in on through the gateway: 'chat.completions', "
        "'completions', 'responses' or 'messages', with '+stream' where it was streamed (None: the built-in agent)",
    )
    role: str | None = Field(
        None,
        description="the role that made the call, where several agents act in one episode (the `model` name an "
        "agent program sent; orchestrate's agent.roles); None: the episode's one agent",
    )

    def token_versions(self) -> list[int]:
        """The policy version that sampled each output token."""
        versions, version, changes = [], self.policy_version, iter(self.version_changes)
        change = next(changes, None)
        for i in range(len(self.output_token_ids)):
            while change is not None and change.token <= i:
                version, change = change.version, next(changes, None)
            versions.append(version)
        return versions

    @property
    def newest_version(self) -> int:
        """The version of its last token: the newest weights that took part."""
        return self.version_changes[-1].version if self.version_changes else self.policy_version


class StepMetadata(OpenTapeModel):
    """TapeAgents' step metadata: which node of which agent made the step, from which LLM call."""

    id: str = Field(default_factory=new_id)
    prompt_id: str = Field("", description="id of the LLMCall that produced this step; '' if none")
    node: str = ""
    agent: str = ""
    other: dict[str, JsonValue] = Field(default_factory=dict)


class Step(TapeModel):
    """A step of a tape. Subclasses set `kind` as a Literal and are registered by it."""

    model_config = ConfigDict(extra="forbid")
    registry: ClassVar[dict[str, type[Step]]] = {}

    metadata: StepMetadata = Field(default_factory=StepMetadata)
    kind: str

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        field = cls.model_fields.get("kind")
        if field is None or field.default in (None, ...) or not isinstance(field.default, str):
            return  # an abstract family (Observation, Thought, Action) or a mixin
        other = Step.registry.get(field.default)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise TypeError(f"step kind {field.default!r} is already used by {other.__module__}.{other.__qualname__}")
        Step.registry[field.default] = cls

    @classmethod
    def parse_step(cls, data: Any) -> Step:
        if isinstance(data, Step):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"a step must be an object, got {type(data).__name__}")
        kind = data.get("kind")
        step_cls = Step.registry.get(kind)  # type: ignore[arg-type]
        if step_cls is None:
            known = ", ".join(sorted(Step.registry))
            raise ValueError(f"unknown step kind {kind!r} (known kinds: {known})")
        return step_cls.model_validate(data)


class Observation(Step):
    """What the agent is told: a task, a tool result, a message."""


class Thought(Step):
    """What the agent thinks; not visible to the environment."""


class Action(Step):
    """What the agent does: answers, calls a tool."""


class EnvObservation(Observation):
    """What the environment said: the first observation (turn 0, from reset) or its answer to the action of
    `turn`, with that action's reward and whether the episode ended there."""

    kind: Literal["env_observation"] = "env_observation"
    text: str
    turn: int = Field(0, description="0: from reset(); t: the answer to the agent's action in turn t")
    reward: float | None = Field(None, description="reward of the action this answers (None for reset)")
    terminated: bool = Field(False, description="the episode reached an end state (solved, lost, answered)")
    truncated: bool = Field(
        False, description="the episode was cut: turn limit, output cut by max_tokens, context full"
    )
    info: dict[str, JsonValue] = Field(default_factory=dict, description="the environment's info, JSON-safe")


class EnvAction(Action):
    """What the agent sent the environment in one turn: its whole output text."""

    kind: Literal["env_action"] = "env_action"
    text: str
    turn: int = 1


class ToolCallAction(EnvAction):
    """An agent turn that called a tool: its whole output (`text`) and the call read from it."""

    kind: Literal["tool_call"] = "tool_call"  # type: ignore[assignment]
    tool: str = Field(description="the tool called: python, search")
    call: str = Field(description="what the tool was given: the code, the query")


class AgentMessage(EnvAction):
    """An agent program's call answered without a tool call: the assistant's reply (`text`, as sampled)."""

    kind: Literal["agent_message"] = "agent_message"  # type: ignore[assignment]


class ProgramMessage(Observation):
    """A message an agent program added to its conversation (a user or system message; tool results are
    `ToolResultObservation`s), read from the call that first sent it: `turn` is the call it follows."""

    kind: Literal["program_message"] = "program_message"
    role: str
    text: str
    turn: int = 0


class HarnessOutput(Observation):
    """How a harness command (`--agent.command`) ended, with the last of what it printed: its calls through
    the gateway are on the tape as a program's are; this is what it said outside them."""

    kind: Literal["harness_output"] = "harness_output"
    text: str = Field("", description="the last characters it printed (stdout and stderr)")
    exit_code: int | None = Field(None, description="its exit status (None: killed at its time limit)")
    timed_out: bool = False
    seconds: float = 0.0
    dropped_chars: int = Field(0, description="what it printed before `text`, not kept")


class ToolResultObservation(EnvObservation):
    """A tool's answer to the call of `turn`: `text` is what the agent reads next; `info` holds the details
    (stdout, stderr, exit code, timed out, output cut)."""

    kind: Literal["tool_result"] = "tool_result"  # type: ignore[assignment]
    tool: str = Field(description="the tool that answered")


class TapeMetadata(OpenTapeModel):
    """TapeAgents' tape metadata, plus what RL needs on every tape."""

    id: str = Field(default_factory=new_id)
    parent_id: str | None = Field(None, description="the tape this one continues or was replayed from")
    author: str | None = Field(None, description="the agent that wrote the latest steps")
    author_tape_id: str | None = None
    n_added_steps: int = 0
    error: str | None = Field(None, description="why the agent failed, if it did")
    result: JsonValue = Field(default_factory=dict)
    task_id: str = ""
    group_id: str = Field("", description="attempts at the same task in one iteration share it (a GRPO group)")
    iteration: int = 0
    policy_version: int = 0
    reward: float | None = Field(None, description="the episode's total reward (sum over turns, undiscounted)")
    reward_reason: str = ""
    success: bool | None = Field(None, description="the environment's own notion of solved (info['success'])")
    turns: int = Field(0, description="agent turns (LLM calls that acted) in the episode")
    terminated: bool = False
    truncated: bool = False
    branch_at: int | None = Field(
        None, description="a fork: the calls replayed from the parent tape (parent_id) before sampling went live"
    )
    dropped: str | None = Field(
        None, description="why the tape was left out of its iteration's batch ('dynamic_sampling'); none: it was not"
    )
    counterfactual: str | None = Field(
        None,
        description="a counterfactual fork (rollouts.counterfactual): the role played again from branch_at, whose "
        "sample is credited against its parent's same role; the fork's other calls are not trained",
    )


class Tape(OpenTapeModel):
    """A complete, replayable record of one attempt."""

    metadata: TapeMetadata = Field(default_factory=TapeMetadata)
    context: JsonValue = None
    steps: list[SerializeAsAny[Step]] = Field(default_factory=list)
    llm_calls: list[LLMCall] = Field(default_factory=list)

    @field_validator("steps", mode="before")
    @classmethod
    def _steps_by_kind(cls, value: Any) -> list[Step]:
        if not isinstance(value, list):
            raise ValueError("steps must be a list")
        return [Step.parse_step(item) for item in value]

    def append(self, step: Step, llm_call: LLMCall | None = None) -> Tape:
        """Add a step (and the call that made it, once) and return the tape."""
        if llm_call is not None:
            step.metadata.prompt_id = llm_call.id
            if not any(call.id == llm_call.id for call in self.llm_calls):
                self.llm_calls.append(llm_call)
        self.steps.append(step)
        self.metadata.n_added_steps += 1
        return self

    def llm_call(self, prompt_id: str) -> LLMCall | None:
        return next((call for call in self.llm_calls if call.id == prompt_id), None)

    def last(self, step_type: type[Step]) -> Step | None:
        return next((step for step in reversed(self.steps) if isinstance(step, step_type)), None)


def call_chains(calls: list[LLMCall]) -> list[list[LLMCall]]:
    """Runs of calls whose prompt ids each extend the previous call's prompt + output ids: the turns of an
    episode that can be computed as one sequence (a re-rendered prompt starts a new run)."""
    chains: list[list[LLMCall]] = []
    previous: list[int] | None = None
    for call in calls:
        ids = call.prompt_token_ids
        if previous is not None and len(ids) > len(previous) and ids[: len(previous)] == previous:
            chains[-1].append(call)
        else:
            chains.append([call])
        previous = ids + call.output_token_ids
    return chains
