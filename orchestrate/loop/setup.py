"""One run set-up that every command shares: what a command needs, built from a run's config.

The loop (orchestrate.loop.iteration), eval (orchestrate.eval), fork, replay and offline (orchestrate.after)
build the run's agent, its servers and its learner here, so that each is built one way.
"""

from __future__ import annotations

import json
from pathlib import Path

from agents.agent import Agent, ChatAgent
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from orchestrate.loop.config import RLConfig
from tapes.tape import SamplingParams


def build_agent(config: RLConfig, tokenizer) -> Agent:
    """The agent a run uses (replay and offline build it the same way from the run's config): the built-in
    ChatAgent, or the program of `--agent.program` through the gateway (orchestrate.gateway.agent) with the
    options of `--program.*`. Use it as `with build_agent(...) as agent:` (a program's gateway is closed)."""
    r, a = config.rollouts, config.agent
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
    if a.program is None:
        return ChatAgent(a, sampling, ChatTokens(tokenizer), max_context=config.server.max_model_len)
    from orchestrate.gateway.agent import ProgramAgent

    p, spec = config.program, EnvSpec.from_config(config, "train")
    return ProgramAgent(a.program, sampling, tokenizer, max_context=config.server.max_model_len,
                        tool_parser=p.tool_parser, time_limit_s=p.time_limit_s, host=p.gateway_host,
                        port=p.gateway_port, sandbox=spec.sandbox, reward=p.reward)  # fmt: skip


def agent_from_run_config(config_path: Path) -> Agent:
    from transformers import AutoTokenizer

    from orchestrate.serving.models import resolve_model

    config = RLConfig.model_validate(json.loads(config_path.read_text()))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model.policy))
    return build_agent(config, tokenizer)
