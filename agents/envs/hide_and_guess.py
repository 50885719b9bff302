"""Hide and guess: a two-player game on GEM's multi-agent API (`gem/multiagent/`), one role per player.

    hider:   Pick a secret whole number between 1 and 20 ... -> \\boxed{13}
    guesser: I am thinking of a number between 1 and 20. You have 5 guesses. ... -> \\boxed{10}
    hider:   Your number is 13. The guesser says 10. Is your number higher or lower? -> \\boxed{higher}
    guesser: 10 is too low. The number is between 11 and 20. 4 guesses left. -> \\boxed{15}
    ...

The hider picks the secret, then answers each wrong guess with higher or lower; the guesser guesses. Turns
alternate (GEM's sequential agent selector: hider, guesser, hider, ...). The environment keeps the hider
honest: it is reminded of its number each time, and an answer that is not the truth about it, or cannot be
read, costs the hider `reward_dishonest` and the guesser is told the truth. A secret that cannot be read or
is outside the range costs it `reward_invalid` and one is drawn from the episode's seed instead (and told to
it). A guess that cannot be read uses up a guess and the guesser goes again. At the game's end the winner
earns `reward_win`: the guesser for finding the number (the game ends there), the hider when the guesses run
out; each agent's info says whether it won (`success`), the guesser's last being the episode's.

It speaks GEM's multi-agent protocol structurally (no dependency on the `gem` package): `possible_agents`,
`agents`, `agent_selector.get_active_agents()`, `reset(seed) -> ({agent: observation}, {agent: info})`,
`step({agent: action}) -> (observations, rewards, terminations, truncations, infos)`, each a dict by agent,
and `observe(agent)`; a subclass of GEM's `MultiAgentEnv` is played the same way (agents.multi_agent).
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agents.envs.base import episode_seed
from agents.envs.registry import register
from agents.rewards import last_boxed

HIDER, GUESSER = "hider", "guesser"
_WHOLE_NUMBER = re.compile(r"[+-]?\d{1,18}")


class HideOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    low: int = Field(1, description="smallest number the secret may be")
    high: int = Field(20, description="largest number the secret may be")
    guesses: int = Field(5, ge=1, le=100, description="guesses the guesser has")
    reward_win: float = Field(1.0, allow_inf_nan=False, description="the winner's reward at the game's end")
    reward_dishonest: float = Field(
        -0.5, allow_inf_nan=False, description="the hider's reward for an answer that is not the truth, or unreadable"
    )
    reward_invalid: float = Field(
        -1.0, allow_inf_nan=False, description="the hider's reward for a secret it did not give within the range"
    )

    @model_validator(mode="after")
    def _range(self) -> HideOptions:
        if self.low >= self.high:
            raise ValueError(f"low {self.low} must be below high {self.high}")
        return self


class Sequential:
    """GEM's AgentSelector in its sequential mode: one active agent at a time, in turn."""

    def __init__(self, agents: list[str]):
        self.order, self.index = list(agents), 0

    def get_active_agents(self) -> list[str]:
        return [self.order[self.index]]

    def next(self) -> None:
        self.index = (self.index + 1) % len(self.order)


def _number(text: str) -> int | None:
    boxed = last_boxed(text)
    return int(boxed.strip()) if boxed is not None and _WHOLE_NUMBER.fullmatch(boxed.strip()) else None


class HideAndGuessEnv:
    possible_agents = [HIDER, GUESSER]

    def __init__(self, options: HideOptions, split: str, run_seed: int):
        self.options, self.split, self.run_seed = options, split, run_seed
        self.agents: list[str] = []
        self.agent_selector = Sequential(self.possible_agents)

    def reset(self, seed: int | None = None) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        self.rng = random.Random(episode_seed(self.run_seed, self.split, seed or 0, salt="hide_and_guess"))
        self.agents = list(self.possible_agents)
        self.agent_selector = Sequential(self.possible_agents)
        self.secret: int | None = None
        self.known = (self.options.low, self.options.high)
        self.left = self.options.guesses
        self.last_guess: int | None = None
        self.made = 0  # guesses made
        self.told = ""  # what the guesser was last told
        return {a: self.observe(a) for a in self.agents}, {a: {} for a in self.agents}

    def observe(self, agent: str) -> str:
        o = self.options
        if agent == HIDER and self.secret is None:
            return (f"Pick a secret whole number between {o.low} and {o.high}; another player will try to guess it "
                    f"in {o.guesses} guesses. Put it in \\boxed{{}}, e.g. \\boxed{{{o.low + 2}}}.")  # fmt: skip
        if agent == HIDER:
            return (f"Your number is {self.secret}. The guesser says {self.last_guess}. Is your number higher or "
                    "lower? Answer \\boxed{higher} or \\boxed{lower}.")  # fmt: skip
        if not self.made:
            return (f"I am thinking of a number between {o.low} and {o.high}. You have {o.guesses} guesses. After "
                    "each guess I say whether the number is higher or lower. Put your guess in \\boxed{}, e.g. "
                    f"\\boxed{{{(o.low + o.high) // 2}}}.")  # fmt: skip
        lo, hi = self.known
        return f"{self.told} The number is between {lo} and {hi}. {self.left} guess{'es' * (self.left != 1)} left."

    def step(self, actions: dict[str, str]):
        (agent,) = self.agent_selector.get_active_agents()
        if set(actions) != {agent}:
            raise ValueError(f"it is {agent}'s turn; got actions of {sorted(actions)}")
        rewards = {a: 0.0 for a in self.agents}
        info: dict[str, Any] = {}
        won: str | None = None
        if agent == HIDER and self.secret is None:
            picked = _number(actions[HIDER])
            if picked is None or not self.options.low <= picked <= self.options.high:
                rewards[HIDER] = self.options.reward_invalid
                picked = self.rng.randint(self.options.low, self.options.high)
                info = {"format_error": True, "reason": "no secret in the range: one was drawn"}
            self.secret = picked
        elif agent == HIDER:
            truth = "higher" if self.secret > self.last_guess else "lower"
            said = (last_boxed(actions[HIDER]) or "").strip().lower()
            if said != truth:
                rewards[HIDER] = self.options.reward_dishonest
                info = {"format_error": said not in ("higher", "lower"), "reason": f"said {said or 'nothing'!r}"}
            self.told = f"{self.last_guess} is too {'low' if truth == 'higher' else 'high'}."
        else:
            guess = _number(actions[GUESSER])
            self.left, self.made, self.last_guess = self.left - 1, self.made + 1, guess
            if guess == self.secret:
                won, info = GUESSER, {"reason": "found"}
            elif self.left <= 0:
                won, info = HIDER, {"reason": f"out of guesses; the number was {self.secret}"}
            elif guess is None:
                self.told, info = "That guess could not be read.", {"format_error": True}
                self.agent_selector.next()  # the guesser goes again: the hider has nothing to answer
            else:
                lo, hi = self.known
                self.known = (max(lo, guess + 1), hi) if guess < self.secret else (lo, min(hi, guess - 1))
        self.agent_selector.next()
        done = won is not None
        if done:
            rewards[won] = self.options.reward_win
        terminations = dict.fromkeys(self.agents, done)
        infos = {a: {**(info if a == agent else {}), **({"success": a == won} if done else {})}
                 for a in self.possible_agents}  # fmt: skip
        if done:
            self.agents = []
        up_next = set() if done else set(self.agent_selector.get_active_agents())
        observations = {a: self.observe(a) if a in up_next else "" for a in self.possible_agents}
        return observations, rewards, terminations, dict.fromkeys(terminations, False), infos


@register("game:hide_and_guess", HideOptions, "two players: a hider picks a number and answers higher/lower, a "
          "guesser guesses (GEM's multi-agent API; --agent.roles binds hider and guesser)", agents=(HIDER, GUESSER))  # fmt: skip
def make_hide_and_guess(options: HideOptions, split: str, run_seed: int) -> HideAndGuessEnv:
    return HideAndGuessEnv(options, split, run_seed)
