"""The built-in agent for environments of several agents (GEM's multi-agent API, `gem/multiagent/`): each agent id
of the environment is a role of the run (`--agent.roles`), with a conversation of its own.

    observations, infos = env.reset(seed)                      # {agent: observation}
    observations, rewards, terminations, truncations, infos = env.step({agent: action})

Each step, the agents the environment makes active (its `agent_selector`: one in turn, GEM's sequential mode,
or all at once, its parallel mode; without one, every agent still in `env.agents`) are each asked with
`env.observe(agent)` as their next user message: an agent's first call is its system prompt and that
observation, each later call extends its own previous call token-exactly (its prompt ids + sampled ids + the
new observation's). Every call is one turn of the episode, recorded with its role; an agent's reward goes on
its latest call's turn, whenever the environment gives it (a hider paid when the guesser runs out of guesses).
A reward to an agent before its first call has no turn to go on and is dropped. The episode ends when no
agent is left, when an output is cut by max_tokens (that agent's turn earns
`truncation_reward`) or at `max_turns` calls. A role bound to `base` is answered by the LLM's base model, one
bound to `adapter` by its own adapter. The built-in agent's `instruction` and `examples` are one agent's and
do not apply here: each role's worked examples are `role_examples` (its first call shows them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agents.agent import Agent, AgentConfig, RoleLLMs, TokenLLM, example_turns, summarize
from agents.chat import ChatTokens
from agents.envs.base import Env, capabilities, jsonable
from tapes.tape import EnvAction, EnvObservation, LLMCall, SamplingParams, Tape


class _Thread:
    """One agent's conversation: its messages, prompt (text and ids) for the next call, its last call."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.prompt_text = ""
        self.prompt_ids: list[int] = []
        self.last: LLMCall | None = None


class MultiAgentChatAgent(Agent):
    """Plays GEM-style multi-agent environments, each agent id a role of the run."""

    name = "multi_agent"

    def __init__(self, config: AgentConfig, sampling: SamplingParams, chat: ChatTokens, max_context: int | None = None):
        self.config, self.sampling, self.chat, self.max_context = config, sampling, chat, max_context

    def _record(self, tape: Tape, step, call: LLMCall | None = None) -> None:
        step.metadata.agent = self.name
        step.metadata.node = "act" if call is not None else "env"
        tape.append(step, llm_call=call)

    def _prompt(self, thread: _Thread, observation: str, role: str) -> None:
        """The agent's next prompt: its first (system prompt, the role's worked examples, the observation), or its
        last call continued."""
        if thread.last is None:
            system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
            examples = example_turns(self.config.role_examples.get(role, []))
            thread.messages = [*system, *examples, {"role": "user", "content": observation}]
            thread.prompt_text, thread.prompt_ids = self.chat.first_prompt(thread.messages)
            return
        out = thread.last.output_token_ids
        delta_text, delta_ids = self.chat.continuation(out, observation)
        thread.messages += [{"role": "assistant", "content": thread.last.output_text},
                            {"role": "user", "content": observation}]  # fmt: skip
        thread.prompt_text += self.chat.tokenizer.decode(out, skip_special_tokens=False) + delta_text
        thread.prompt_ids = thread.last.prompt_token_ids + out + delta_ids

    async def run_episode(
        self, env: Env, seed: int, llm: TokenLLM, tape: Tape, sampling: SamplingParams | None = None
    ) -> Tape:
        sampling = sampling or self.sampling
        agents = capabilities(env).agents
        unbound = [a for a in agents if a not in self.config.roles]
        if not agents or unbound:
            raise ValueError(f"the environment's agents {list(agents)} are not all roles of the run "
                             f"({', '.join(self.config.roles)}): bind each with --agent.roles")  # fmt: skip
        tape.metadata.author = self.name
        observations, _ = env.reset(seed=seed)
        self._record(tape, EnvObservation(text="\n\n".join(f"[{a}] {o}" for a, o in observations.items()), turn=0,
                                          info={"observations": jsonable(observations)}))  # fmt: skip
        threads = {a: _Thread() for a in agents}
        last_turn: dict[str, int] = {}
        llm_for = RoleLLMs(llm, self.config.roles)
        turn = 0
        while env.agents:
            selector = getattr(env, "agent_selector", None)
            active = [a for a in (selector.get_active_agents() if selector else env.agents) if a in env.agents]
            if turn + len(active) > self.config.max_turns:
                self._end(tape, turn, f"turn limit ({self.config.max_turns} calls) reached")
                break
            for agent in active:
                self._prompt(threads[agent], str(env.observe(agent)), agent)
            full = [a for a in active if self.max_context and len(threads[a].prompt_ids) + sampling.max_tokens
                    > self.max_context]  # fmt: skip
            if full:
                self._end(tape, turn, f"context full: {full[0]}'s prompt of {len(threads[full[0]].prompt_ids)} "
                                      f"tokens + {sampling.max_tokens} new > max_model_len {self.max_context}")  # fmt: skip
                break
            calls = await asyncio.gather(*(llm_for(a).complete_ids(
                threads[a].prompt_ids, sampling, messages=list(threads[a].messages), prompt_text=threads[a].prompt_text)
                for a in active))  # fmt: skip
            cut = False
            for agent, call in zip(active, calls):
                turn += 1
                call.turn, call.role = turn, agent
                thread = threads[agent]
                if thread.last is not None:
                    before = thread.last.prompt_token_ids + thread.last.output_token_ids
                    ids = call.prompt_token_ids
                    call.extends_previous = len(ids) > len(before) and ids[: len(before)] == before
                thread.last, last_turn[agent] = call, turn
                self._record(tape, EnvAction(text=call.output_text, turn=turn), call)
                if call.finish_reason == "length":
                    cut = True
                    self._record(tape, EnvObservation(text="", turn=turn, reward=self.config.truncation_reward,
                                                      truncated=True, info={"reason": "truncated: output cut by "
                                                      "max_tokens", "success": False, "role": agent}))  # fmt: skip
            if cut:
                break
            observed, rewards, terminations, truncations, infos = env.step(
                {a: c.output_text for a, c in zip(active, calls)}
            )
            for agent in agents:
                acted = agent in active
                if agent not in last_turn or not (acted or rewards.get(agent)):
                    continue  # no turn to put it on, or nothing to say of an agent that did not act
                info = {**jsonable(infos.get(agent, {})), "role": agent}
                self._record(tape, EnvObservation(
                    text=str(observed.get(agent, "")) if acted else "", turn=last_turn[agent],
                    reward=float(rewards.get(agent, 0.0)), terminated=bool(terminations.get(agent, False)),
                    truncated=bool(truncations.get(agent, False)), info=info))  # fmt: skip
        summarize(tape)
        return tape

    def _end(self, tape: Tape, turn: int, reason: str) -> None:
        """The episode stopped from outside the game (its turn limit, a full context): truncated."""
        last = tape.steps[-1]
        if isinstance(last, EnvObservation):
            last.truncated = True
            last.info["reason"] = reason
        else:
            self._record(tape, EnvObservation(text="", turn=max(1, turn), truncated=True, info={"reason": reason}))
