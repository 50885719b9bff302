"""LLMs that answer from a tape's recorded calls, with the agent's interface (`complete_ids`).

`ReplayLLM` answers from the calls recorded on a tape: re-running an agent with it gives the same tape back,
which is how a change to an agent is checked against old tapes (`orchestrate.after.replay`). `ForkLLM` answers a
tape's first calls the same way and the rest live: a fork continues an episode from one of its calls
(`orchestrate.after.fork`).
"""

from __future__ import annotations

from typing import Any

from orchestrate.serving.llm import LLMError
from tapes.tape import LLMCall, SamplingParams, Tape


class ReplayLLM:
    """Answers from the LLM calls recorded on a tape, in order.

    strict (the default): a prompt whose token ids differ from the recorded
    ones is an LLMError. strict=False answers anyway and notes the difference
    in `mismatches` (call number, what differs), so a replay can go on and
    report every step that changed; a different sampling setting is only
    noted. Either way, asking for more calls than the tape recorded is an
    LLMError. The first `inherited` calls (a fork's, replayed from its
    parent) keep the parent's sampling: theirs is not compared.
    """

    def __init__(self, tape: Tape, strict: bool = True, inherited: int = 0):
        self.calls = list(tape.llm_calls)
        self.position = 0
        self.strict = strict
        self.inherited = inherited
        self.mismatches: list[tuple[int, str]] = []

    async def complete_ids(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_text: str = "",
    ) -> LLMCall:
        if self.position >= len(self.calls):
            raise LLMError(f"replay: the agent made call #{self.position + 1}; the tape recorded {len(self.calls)}")
        call = self.calls[self.position]
        self.position += 1
        if call.prompt_token_ids != list(prompt_ids):
            problem = f"call #{self.position} prompt differs from the recorded one: "
            problem += _first_message_difference(call.messages, list(messages or []))
            problem += "; " + _first_id_difference(call.prompt_token_ids, list(prompt_ids))
            if self.strict:
                raise LLMError("replay: " + problem)
            self.mismatches.append((self.position, problem))
        if call.sampling != sampling and self.position > self.inherited:  # noted, never fatal
            self.mismatches.append(
                (
                    self.position,
                    f"call #{self.position} sampling differs: recorded "
                    f"{call.sampling.model_dump()}, now {sampling.model_dump()}",
                )
            )
        replayed = call.model_copy(deep=True)
        replayed.turn, replayed.extends_previous = 1, None  # the agent sets these again
        return replayed


class ForkDiverged(LLMError):
    """A fork's agent asked a replayed call with another prompt than the tape recorded: it did not come back
    to the point the fork branches from."""


class ForkLLM:
    """A fork of `tape` at call `at`: the first `at` calls are answered from the tape, strictly (a prompt whose
    token ids differ from the recorded ones is a ForkDiverged naming the call), every later call by `live`
    (a VLLMClient: the policy now) with the sampling the agent asks for. The replayed calls come back as
    recorded (model, policy version, log-probs); the live ones are new. `replayed` and `live_calls` count
    what was asked: fewer than `at` replayed means the episode ended before the fork's branch point.
    """

    def __init__(self, tape: Tape, at: int, live: Any):
        if not 0 <= at <= len(tape.llm_calls):
            raise ValueError(f"at={at}: the tape recorded {len(tape.llm_calls)} LLM calls")
        self.at = at
        self._replay = ReplayLLM(tape, strict=True)
        self._replay.calls = self._replay.calls[:at]
        self.live = live
        self.live_calls = 0

    @property
    def replayed(self) -> int:
        return self._replay.position

    async def complete_ids(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_text: str = "",
        base: bool = False,
        role: str | None = None,
        binding: str | None = None,
    ) -> LLMCall:
        if self._replay.position < self.at:
            try:
                return await self._replay.complete_ids(prompt_ids, sampling, messages=messages, prompt_text=prompt_text)
            except LLMError as exc:
                raise ForkDiverged(f"fork at call {self.at}: {str(exc).removeprefix('replay: ')}") from None
        self.live_calls += 1
        if binding is not None:
            live = self.live.model_of(binding)
        else:
            live = self.live.base_model() if base else self.live.role_model(role) if role is not None else self.live
        return await live.complete_ids(prompt_ids, sampling, messages=messages, prompt_text=prompt_text)

    def base_model(self) -> _ForkServed:
        """The base model's calls (roles bound to `base`): replayed as any, then the live LLM's base model."""
        return _ForkServed(self)

    def role_model(self, role: str) -> _ForkServed:
        """A role's own adapter's calls (roles bound to `adapter`): replayed as any, then the live LLM's."""
        return _ForkServed(self, role)

    def model_of(self, binding: str) -> _ForkServed:
        """A frozen model's calls (roles bound to a model): replayed as any, then the live LLM's model's."""
        return _ForkServed(self, binding=binding)


class _ForkServed:
    """A fork's base model (roles bound to `base`), a role's own adapter (bound to `adapter`) or a frozen model
    (bound to a model): its replayed calls from the tape, then the live LLM's."""

    def __init__(self, fork: ForkLLM, role: str | None = None, binding: str | None = None):
        self.fork, self.role, self.binding = fork, role, binding

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text: str = "") -> LLMCall:
        return await self.fork.complete_ids(prompt_ids, sampling, messages=messages, prompt_text=prompt_text,
                                            base=self.role is None and self.binding is None, role=self.role,
                                            binding=self.binding)  # fmt: skip


def _first_id_difference(recorded: list[int], now: list[int]) -> str:
    for i, (a, b) in enumerate(zip(recorded, now)):
        if a != b:
            return f"token {i} was {a}, now {b}"
    return f"recorded {len(recorded)} prompt tokens, now {len(now)}"


def _first_message_difference(recorded: list[dict[str, Any]], now: list[dict[str, Any]]) -> str:
    for i, (a, b) in enumerate(zip(recorded, now)):
        if a != b:
            return f"message {i + 1} was {_short(a)}, now {_short(b)}"
    if len(recorded) != len(now):
        return f"recorded {len(recorded)} messages, now {len(now)}"
    return "same messages"


def _short(message: dict[str, Any], width: int = 120) -> str:
    text = repr(message)
    return text if len(text) <= width else text[: width - 3] + "..."
