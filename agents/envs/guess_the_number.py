"""Guess the number: a small multi-turn game, answered higher / lower after each guess.

    I am thinking of a number between 1 and 10. You have 4 guesses. ...
    -> \\boxed{5}
    Your guess 5 is too low: the number is higher than 5. 3 guesses left.

Rewards follow GEM's `game:GuessTheNumber-v0-easy` where it is sound: 1 for
the right number (the episode ends, success), 0 for a wrong guess, and a
guess that cannot be read (no `\\boxed{}` with a whole number in it) gets
-0.1 and by default ends the episode. Unlike GEM, running out of guesses
gives 0 (GEM pays up to 0.9 for a last guess that is close, so a lost game
looks like a success), and the game is lost, not truncated: it is the rule
of the game, not a limit outside it. A guess outside the range counts as a
guess and is answered like any other.

`reward_narrowing` C (off by default) adds partial credit for informative
guesses: each guess earns C x log2(size before / size after) / log2(size of the
whole range) for the candidates it rules out (a right guess leaves one), so a
won game collects C in all whatever its path, a lost one less, and with a
discount the guesses that halve the range early earn most: bisection maximises
it. A guess outside the range still open rules nothing out and earns 0.

The number is drawn from (run seed, split, episode seed) for train episodes;
the held-out episodes 0 .. n-1 (n = high - low + 1, the `test_size`) take
every number once, in an order set by the run seed.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agents.envs.base import episode_seed
from agents.envs.registry import register
from agents.rewards import last_boxed

_WHOLE_NUMBER = re.compile(r"[+-]?\d{1,18}")


class GuessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    low: int = Field(1, description="smallest number the target can be")
    high: int = Field(10, description="largest number the target can be")
    max_turns: int = Field(4, ge=1, le=1000, description="guesses allowed; the game is lost when they run out")
    reward_correct: float = Field(1.0, allow_inf_nan=False, description="reward of the right guess")
    reward_invalid: float = Field(
        -0.1,
        allow_inf_nan=False,
        description="reward of a guess that cannot be read (no \\boxed{} holding a whole number)",
    )
    invalid_ends_episode: bool = Field(
        True,
        description="an unreadable guess ends the game (GEM's rule); "
        "otherwise it uses up one guess and the game goes on",
    )
    reward_narrowing: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="per guess, this x the bits of the range it rules out / the bits of the whole range "
        "(log2(before / after) / log2(high - low + 1)): a won game collects it in all, a lost one the share "
        "of the range its guesses ruled out; 0: off",
    )
    feedback: Literal["direction", "range"] = Field(
        "direction",
        description="direction: each answer says higher or lower than the guess (GEM's game); range: "
        "it also says the range the number is known to lie in after all guesses so far (the state in one message)",
    )

    @model_validator(mode="after")
    def _range(self) -> GuessOptions:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be smaller than high ({self.high})")
        return self


def _guesses(k: int) -> str:
    return f"{k} guess left" if k == 1 else f"{k} guesses left"


class GuessTheNumberEnv:
    def __init__(self, options: GuessOptions, split: str, run_seed: int):
        self.options, self.split, self.run_seed = options, split, run_seed
        self.test_size: int | None = options.high - options.low + 1
        self.target: int | None = None
        self.turn = 0
        self.known = (options.low, options.high)  # the range the answers so far leave

    def _target(self, seed: int) -> int:
        o = self.options
        span = o.high - o.low + 1
        if self.split == "test":  # held-out episodes 0 .. span-1 take every number once
            offset = episode_seed(self.run_seed, "test", 0, salt="guess_the_number") % span
            return o.low + (seed + offset) % span
        rng = random.Random(episode_seed(self.run_seed, self.split, seed, salt="guess_the_number"))
        return rng.randint(o.low, o.high)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        o = self.options
        self.target = self._target(0 if seed is None else int(seed))
        self.turn = 0
        self.known = (o.low, o.high)
        observation = (
            f"I am thinking of a number between {o.low} and {o.high}. "
            f"You have {o.max_turns} {'guess' if o.max_turns == 1 else 'guesses'}. "
            "After each guess I say whether the number is higher or lower. "
            f"Put your guess in \\boxed{{}}, e.g. \\boxed{{{(o.low + o.high) // 2}}}."
        )
        return observation, {"target": self.target, "low": o.low, "high": o.high}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.target is None:
            raise RuntimeError("step() before reset()")
        o, target = self.options, self.target
        self.turn += 1
        left = o.max_turns - self.turn
        boxed = last_boxed(action)
        guess = int(boxed) if boxed is not None and _WHOLE_NUMBER.fullmatch(boxed) else None
        info: dict[str, Any] = {"success": False, "format_error": guess is None, "guess": guess, "turn": self.turn}
        if guess is None:
            info["reason"] = "no \\boxed{} holding a whole number"
            told = "I could not read a guess: put one whole number in \\boxed{}, e.g. \\boxed{5}."
            if o.invalid_ends_episode or left <= 0:
                return f"{told} The game is over: the number was {target}.", o.reward_invalid, True, False, info
            return f"{told} It counts as a guess.{self._hint()} {_guesses(left)}.", o.reward_invalid, False, False, info
        before = self.known
        if guess == target:
            info.update(success=True, reason="correct")
            self.known = (target, target)
            reward = o.reward_correct + self._narrowing(before)
            return f"Correct! The number is {target}.", reward, True, False, info
        if not o.low <= guess <= o.high:
            info["reason"] = "out of range"
            told = f"Your guess {guess} is outside the range {o.low} to {o.high}; it still counts as a guess."
            if o.feedback == "direction":
                told += f" The number is between {o.low} and {o.high}."
        else:
            info["reason"] = "too low" if guess < target else "too high"
            if o.feedback == "range":  # the range says the rest
                told = f"{guess} is {info['reason']}."
            else:
                told = (f"Your guess {guess} is too low: the number is higher than {guess}." if guess < target
                        else f"Your guess {guess} is too high: the number is lower than {guess}.")  # fmt: skip
            lo, hi = self.known
            self.known = (max(lo, guess + 1), hi) if guess < target else (lo, min(hi, guess - 1))
        reward = self._narrowing(before)
        if left <= 0:
            info["reason"] += "; out of guesses"
            return f"{told} You are out of guesses: the number was {target}.", reward, True, False, info
        return f"{told}{self._hint()} {_guesses(left)}.", reward, False, False, info

    def _narrowing(self, before: tuple[int, int]) -> float:
        """The narrowing reward of the guess that took the known range from `before` to `self.known`."""
        o = self.options
        if not o.reward_narrowing:
            return 0.0
        size = lambda r: r[1] - r[0] + 1  # noqa: E731
        return o.reward_narrowing * math.log2(size(before) / size(self.known)) / math.log2(o.high - o.low + 1)

    def _hint(self) -> str:
        """With feedback "range": the range the answers so far leave, as one sentence after a space."""
        if self.options.feedback != "range":
            return ""
        lo, hi = self.known
        return f" The number is between {lo} and {hi}." if lo < hi else f" The number can only be {lo}."


@register("game:guess_the_number", GuessOptions, "guess a number in low..high with higher/lower hints; multi-turn")
def make_guess_the_number(options: GuessOptions, split: str, run_seed: int) -> GuessTheNumberEnv:
    return GuessTheNumberEnv(options, split, run_seed)
