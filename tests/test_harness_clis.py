"""Two real CLI harnesses end to end, as commands (agents.harness): Codex CLI (`codex exec`, OpenAI's Responses
API streamed) and mini-swe-agent (`mini`, litellm on chat completions), each on the code environment against a
scripted LLM with the embedded model's real tokenizer. The scripted model calls the harness's own tool to write
solution.py, then finishes; the environment's tests score the workspace. Each: the tape is token-exact (the
second call extends the first), the protocol it came in on recorded, the harness's output on the tape, and a
strict replay makes the same calls.

Each harness is installed once into a folder of its own under ~/.cache/tapeloop/clients (TAPELOOP_CLIENTS_DIR):
Codex with npm, mini-swe-agent in a venv made with uv. Installing needs the registries once; without them these
tests fail saying so (`-m 'not clients'` deselects them)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agents.envs import make_env
from agents.harness import HarnessProgram
from orchestrate.gateway.agent import MODEL_NAME, ProgramAgent
from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import HarnessOutput, Tape
from tests.programs import SAMPLING, FakeSandbox, ScriptedLLM

pytestmark = pytest.mark.clients

CODEX = "@openai/codex@0.171.0"
MINI_SWE_AGENT = "mini-swe-agent==2.4.6"


def installed(name: str, commands: list[list[str]], folder: Path) -> Path:
    """`folder`, made once by `commands` (each may name it as {folder}) and kept; made again if left half done."""
    ready = folder / ".ready"
    if ready.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    for command in commands:
        if shutil.which(command[0]) is None:
            pytest.fail(f"installing {name} needs {command[0]} on PATH; -m 'not clients' deselects these tests")
        argv = [word.replace("{folder}", str(folder)) for word in command]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            why = (out.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.fail(f"could not install {name} into {folder} ({why}): these tests need its registry once; "
                        "-m 'not clients' deselects them")  # fmt: skip
    ready.write_text(name)
    return folder


def clients_dir() -> Path:
    return Path(os.environ.get("TAPELOOP_CLIENTS_DIR") or Path.home() / ".cache" / "tapeloop" / "clients")


@pytest.fixture(scope="session")
def codex():
    """The `codex` executable of the pinned @openai/codex (npm install --prefix a folder of its own)."""
    folder = clients_dir() / CODEX.removeprefix("@openai/").replace("@", "-")
    installed(CODEX, [["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", "{folder}", CODEX]], folder)
    return folder / "node_modules" / ".bin" / "codex"


@pytest.fixture(scope="session")
def mini():
    """The `mini` executable of the pinned mini-swe-agent (a venv of its own, made with uv)."""
    folder = clients_dir() / MINI_SWE_AGENT.replace("==", "-")
    installed(MINI_SWE_AGENT, [["uv", "venv", "--quiet", "--python", sys.executable, "{folder}"],
                               ["uv", "pip", "install", "--quiet", "--compile-bytecode", "--python", "{folder}/bin/python",
                                MINI_SWE_AGENT]], folder)  # fmt: skip
    return folder / "bin" / "mini"


def code_env(seed=0):
    env = make_env("code", {}, split="train", run_seed=0)
    env.reset(seed=seed)
    return env


def tool_call(name: str, arguments: dict) -> str:
    """A tool call as the embedded model writes one (Hermes: its chat template's format)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def write_solution(seed=0) -> str:
    """A shell command that writes the episode's reference solution into solution.py."""
    return f"cat > solution.py <<'EOF'\n{code_env(seed).problem.solution}\nEOF"


@pytest.fixture
def play(tokenizer):
    """Plays one episode of a harness command. Each episode's workspace is a new folder, seen by the harness at
    one path (agents.harness.fixed_view): Codex writes its folder and home into its prompt, and a replay renders
    the same tokens."""
    agents = []

    def play(command, llm, seed=0):
        # the harnesses' own prompts are long (Codex's tools and instructions: about 8k tokens)
        agent = ProgramAgent(HarnessProgram(command, time_limit_s=120), SAMPLING, tokenizer, max_context=32768,
                             sandbox=FakeSandbox(), time_limit_s=180)  # fmt: skip
        agents.append(agent)
        tape = Tape()
        asyncio.run(agent.run_episode(code_env(seed), seed, llm, tape))
        return tape

    yield play
    for agent in agents:
        agent.close()


def check_episode(tape, protocol, play, command):
    """What both harnesses must show: solved, token-exact, recorded, replayable."""
    (output,) = [s for s in tape.steps if isinstance(s, HarnessOutput)]
    assert tape.metadata.error is None, f"{tape.metadata.error}\n{output.text[-3000:]}"
    assert output.exit_code == 0 and not output.timed_out, output.text[-3000:]
    assert tape.metadata.reward == 1.0 and tape.metadata.success is True  # the environment's tests on solution.py
    first, second = tape.llm_calls
    assert [first.protocol, second.protocol] == [protocol, protocol]
    assert "into the file solution.py" in first.prompt_text  # the task came from the workspace's TASK.md
    assert second.extends_previous is True  # its prompt: the first call's prompt and output, then the tool's result
    n = len(first.prompt_token_ids) + len(first.output_token_ids)
    assert second.prompt_token_ids[:n] == first.prompt_token_ids + first.output_token_ids
    again = play(command, ReplayLLM(tape, strict=True))  # the harness runs again, its calls answered from the tape
    assert [(c.prompt_token_ids, c.output_token_ids) for c in again.llm_calls] == [
        (c.prompt_token_ids, c.output_token_ids) for c in tape.llm_calls
    ]
    assert again.metadata.reward == 1.0
    return output


def codex_catalog(folder: Path) -> Path:
    """Codex's description of the model it drives (its catalog knows OpenAI's models only; for another it falls
    back to a shell tool whose output carries a random id and the wall time, which no replay reproduces): this
    one offers its apply_patch tool, free-form (a `custom` tool on the Responses API)."""
    model = {"slug": MODEL_NAME, "display_name": MODEL_NAME, "description": "the policy in training",
             "base_instructions": "You are a coding agent running in the Codex CLI. Edit files with apply_patch.",
             "shell_type": "shell_command", "apply_patch_tool_type": "freeform", "visibility": "list",
             "supported_in_api": True, "priority": 1, "context_window": 32768, "input_modalities": ["text"],
             "truncation_policy": {"mode": "tokens", "limit": 10000}, "supports_parallel_tool_calls": False,
             "supported_reasoning_levels": [], "default_reasoning_level": None, "supports_reasoning_summaries": False,
             "support_verbosity": False, "experimental_supported_tools": []}  # fmt: skip
    path = folder / "codex-models.json"
    path.write_text(json.dumps({"models": [model]}))
    return path


def codex_command(codex: Path, catalog: Path) -> str:
    """`codex exec` with the episode's gateway as a custom provider on the Responses API; its own sandbox off
    (ours holds the workspace), its hosted web search and its sub-agent tools (a `namespace` tool) off."""
    provider = ('model_providers.tapeloop={name="tapeloop", base_url="{base_url}", env_key="OPENAI_API_KEY", '
                'wire_api="responses", request_max_retries=0, stream_max_retries=0}')  # fmt: skip
    return (f"{codex} exec --skip-git-repo-check --sandbox danger-full-access --model {{model}} "
            f"--disable multi_agent -c 'web_search=\"disabled\"' -c 'model_catalog_json=\"{catalog}\"' "
            f"-c 'model_provider=\"tapeloop\"' -c '{provider}' {{prompt}}")  # fmt: skip


def add_file_patch(name: str, text: str) -> str:
    """An apply_patch patch (Codex's format) that adds the file `name` holding `text`."""
    lines = "".join(f"+{line}\n" for line in text.splitlines())
    return f"*** Begin Patch\n*** Add File: {name}\n{lines}*** End Patch"


def test_codex_exec_writes_the_solution_with_apply_patch_through_the_responses_api(codex, play, tokenizer, tmp_path):
    command = codex_command(codex, codex_catalog(tmp_path))
    patch = add_file_patch("solution.py", code_env().problem.solution)
    llm = ScriptedLLM(tokenizer, [tool_call("apply_patch", {"input": patch}), "I wrote solution.py."])
    tape = play(command, llm)
    output = check_episode(tape, "responses+stream", play, command)
    first, second = tape.llm_calls
    assert "apply_patch" in first.prompt_text and "*** Begin Patch" in first.prompt_text  # its tool and grammar
    assert not llm.replies  # both replies used: Codex applied the patch, sent its result, and stopped at the text
    assert "solution.py" in second.messages[-1]["content"]  # the patch's result, as Codex reported it
    assert "I wrote solution.py." in output.text


def test_mini_swe_agent_writes_the_solution_with_its_bash_tool_through_litellm(mini, play, tokenizer):
    # the model must call bash every turn; it ends by echoing mini's submit word
    command = (f"env MSWEA_CONFIGURED=true MSWEA_COST_TRACKING=ignore_errors LITELLM_LOCAL_MODEL_COST_MAP=True "
               f"{mini} --yolo --exit-immediately --cost-limit 0 --model openai/{{model}} --task {{prompt}}")  # fmt: skip
    replies = [tool_call("bash", {"command": write_solution()}),
               tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})]  # fmt: skip
    llm = ScriptedLLM(tokenizer, replies)
    tape = play(command, llm)
    check_episode(tape, "chat.completions", play, command)
    assert "bash" in tape.llm_calls[0].prompt_text and not llm.replies
