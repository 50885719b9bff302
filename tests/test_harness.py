"""A harness as a command (agents.harness, --agent.command): a real subprocess per episode in a fresh workspace
with the environment's task files, its model the episode's gateway (by URL, from its environment variables),
its reward from the environment's scoring of the workspace; its faults cost its episode, never the run."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time

import pytest

from agents.envs import make_env
from agents.harness import HarnessError, HarnessProgram, check_command, harness_argv
from orchestrate.gateway.agent import ProgramAgent
from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import HarnessOutput, Tape
from tests.programs import SAMPLING, FakeSandbox, ScriptedLLM

# a harness of our own: reads its task, asks the model (OpenAI's chat API, or Anthropic's streamed), writes the
# fenced program it got into solution.py; extra behaviours for the fault tests
HARNESS = textwrap.dedent("""
    import os, re, subprocess, sys, time
    mode = sys.argv[1]
    if mode == "exit-at-once":
        print("harness: no config"); sys.exit(3)
    if mode == "spin":
        while True:
            pass
    if mode == "flood":
        sys.stdout.write("x" * 3_000_000); sys.stdout.flush()
    if mode == "child":
        child = subprocess.Popen(["sleep", os.environ["SLEEP_FOR"]])
        open("child.pid", "w").write(str(child.pid))
        open(os.environ["PIDFILE"], "w").write(str(child.pid))
    task = open("TASK.md").read() if len(sys.argv) < 3 else sys.argv[2]
    if mode == "net":  # can it reach anything but its gateway?
        import socket
        try:
            socket.create_connection(("127.0.0.1", int(os.environ["PROBE_PORT"])), timeout=2).close()
            print("probe: reached")
        except OSError as exc:
            print("probe: refused", exc)
    if mode == "pwd":  # a harness that writes its folder into its prompt, as Codex does
        task = f"Working in {os.getcwd()} (HOME {os.environ['HOME']}).\\n{task}"
    if mode == "anthropic":
        import anthropic
        client = anthropic.Anthropic(max_retries=0)
        with client.messages.stream(model=os.environ["ANTHROPIC_MODEL"], max_tokens=64,
                                    messages=[{"role": "user", "content": task}]) as stream:
            text = stream.get_final_text()
    else:
        import openai
        client = openai.OpenAI(max_retries=0)
        text = client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                              messages=[{"role": "user", "content": task}]).choices[0].message.content
    block = re.search(r"```python\\n(.*?)```", text, re.S)
    open("solution.py", "w").write(block.group(1) if block else text)
    print("harness: wrote solution.py")
""")


@pytest.fixture
def harness(tmp_path):
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    return lambda mode, prompt="": f"{sys.executable} {script} {mode}" + (" {prompt}" if prompt else "")


def code_env(seed=0):
    env = make_env("code", {}, split="train", run_seed=0)
    env.reset(seed=seed)
    return env


def solved(seed=0):
    """The fenced reference solution of the episode's problem: what the scripted model answers."""
    return f"Here it is:\n```python\n{code_env(seed).problem.solution}\n```"


def run(agent, llm, seed=0, env=None):
    tape = Tape()
    asyncio.run(agent.run_episode(env or code_env(seed), seed, llm, tape))
    return tape


@pytest.fixture
def harness_agent(tokenizer):
    made = []

    def make(command, **kw):
        agent = ProgramAgent(HarnessProgram(command, **kw), SAMPLING, tokenizer, max_context=1024,
                             sandbox=FakeSandbox(), time_limit_s=60)  # fmt: skip
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


@pytest.mark.parametrize("mode", ["openai", "anthropic"])
def test_a_harness_command_solves_a_code_task_in_its_workspace_through_the_gateway(
    tokenizer, harness, harness_agent, mode
):
    agent = harness_agent(harness(mode))
    tape = run(agent, ScriptedLLM(tokenizer, [solved()]))
    assert tape.metadata.error is None, tape.metadata.error
    assert tape.metadata.reward == 1.0 and tape.metadata.success is True  # the environment's tests, run on solution.py
    (call,) = tape.llm_calls
    assert call.protocol == ("messages+stream" if mode == "anthropic" else "chat.completions")
    assert "into the file solution.py" in call.prompt_text  # the task came from the workspace's TASK.md
    (output,) = [s for s in tape.steps if isinstance(s, HarnessOutput)]
    assert output.exit_code == 0 and "wrote solution.py" in output.text and not output.timed_out
    assert tape.metadata.author == f"command: {harness(mode)}"
    again = run(agent, ReplayLLM(tape, strict=True))  # the command runs again, its calls answered from the tape
    assert [c.output_token_ids for c in again.llm_calls] == [c.output_token_ids for c in tape.llm_calls]
    assert again.metadata.reward == 1.0


def test_the_prompt_as_an_argument_and_a_wrong_answer_scores_zero(tokenizer, harness, harness_agent):
    tape = run(harness_agent(harness("openai", prompt=True)), ScriptedLLM(tokenizer, ["```python\nx = 1\n```"]))
    assert tape.metadata.error is None and tape.metadata.reward == 0.0  # the model's doing: trained on
    assert "into the file solution.py" in tape.llm_calls[0].prompt_text


def test_a_harness_that_fails_at_once_spins_or_is_not_found_costs_its_episode_only(tokenizer, harness, harness_agent):
    tape = run(harness_agent(harness("exit-at-once")), ScriptedLLM(tokenizer, []))
    assert tape.metadata.error.startswith("the program raised HarnessFailed: the harness exited with status 3")
    assert "before any call to the model: harness: no config" in tape.metadata.error
    start = time.monotonic()
    tape = run(harness_agent(harness("spin"), time_limit_s=1.0), ScriptedLLM(tokenizer, []))
    assert "ran past its time limit" in tape.metadata.error and time.monotonic() - start < 15
    (output,) = [s for s in tape.steps if isinstance(s, HarnessOutput)]
    assert output.timed_out and output.exit_code is None
    with pytest.raises(HarnessError, match="'no-such-harness' is not found on PATH"):
        check_command("no-such-harness --flag")
    with pytest.raises(HarnessError, match="empty"):
        harness_argv("  ", {})


def test_a_harness_that_floods_its_output_or_leaves_children_behind_is_bounded(
    tokenizer, harness, harness_agent, tmp_path
):
    tape = run(harness_agent(harness("flood"), max_output_chars=1000), ScriptedLLM(tokenizer, [solved()]))
    (output,) = [s for s in tape.steps if isinstance(s, HarnessOutput)]
    assert len(output.text) == 1000 and output.dropped_chars >= 3_000_000 - 1000
    assert tape.metadata.reward == 1.0
    for fixed_path in (True, False):  # in its own process namespace (bubblewrap), and in its process group alone
        unique = f"{300 + time.time() % 1:.6f}"
        os.environ["PIDFILE"], os.environ["SLEEP_FOR"] = str(tmp_path / "child.pid"), unique
        try:
            tape = run(harness_agent(harness("child"), fixed_path=fixed_path), ScriptedLLM(tokenizer, [solved()]))
        finally:
            del os.environ["PIDFILE"], os.environ["SLEEP_FOR"]
        assert tape.metadata.reward == 1.0 and (tmp_path / "child.pid").exists()  # it started its child
        (tmp_path / "child.pid").unlink()
        time.sleep(0.2)
        assert not [pid for pid in sleeping(unique) if alive(pid)]  # ended with the harness


def sleeping(seconds: str) -> list[int]:
    """The processes that run `sleep SECONDS`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if cmdline.read().split(b"\0")[:2] == [b"sleep", seconds.encode()]:
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its reaper has ended)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return False


def test_placeholders_are_one_word_each_whatever_they_hold():
    argv = harness_argv(
        "tool run --model {model} --task {prompt}", {"model": "policy", "prompt": "two words; rm -rf /"}
    )
    assert argv == ["tool", "run", "--model", "policy", "--task", "two words; rm -rf /"]


def test_a_program_that_calls_sys_exit_costs_its_episode_not_the_run(tokenizer, agent_for):
    from tests.programs import play

    async def exits(task, client):
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "A"}])
        sys.exit(3)

    tape = play(agent_for(exits), ScriptedLLM(tokenizer, ["x"]))
    assert tape.metadata.error.startswith("the program raised ProgramExited: SystemExit(3): it ended its episode")
    assert "test_harness.py" in tape.metadata.error  # where: the program's own line
    assert len(tape.llm_calls) == 1  # its tape is kept


PROCESS_PROGRAMS = textwrap.dedent("""
    import os, subprocess, sys

    async def ask(task, client):
        reply = await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.observation}])
        return reply.choices[0].message.content

    async def good(task, client):
        return await ask(task, client)

    async def steps(task, client):
        printed = await task.run_python("print(6 * 7)")
        answer = await task.step(await ask(task, client))
        task.reward(0.25 if printed == "42" else -1.0)
        return None

    async def exits(task, client):
        await ask(task, client)
        sys.exit(3)

    async def hard_exit(task, client):
        await ask(task, client)
        os._exit(4)

    async def spins(task, client):
        await ask(task, client)
        while True:
            pass

    async def floods(task, client):
        sys.stdout.write("x" * 5_000_000)
        return await ask(task, client)

    async def leaves_a_child(task, client):
        child = subprocess.Popen(["sleep", os.environ.get("SLEEP_FOR", "300")])
        open(os.environ["PIDFILE"], "w").write(str(child.pid))
        return await ask(task, client)

    async def raises(task, client):
        await ask(task, client)
        raise KeyError("oops")

    BEHAVIOURS = [good, steps, exits, hard_exit, spins, floods, leaves_a_child, raises, good]

    async def play(task, client):  # one program, one fork server: the episode's seed picks the behaviour
        return await BEHAVIOURS[task.seed](task, client)
""")
NAMES = ["good", "steps", "exits", "hard_exit", "spins", "floods", "leaves_a_child", "raises", "good again"]


def test_programs_in_processes_of_their_own_cost_their_episode_whatever_they_do(tokenizer, tmp_path, monkeypatch):
    """--program.isolation process: sys.exit, os._exit, a spin, a flood of output and a child left behind each
    end one episode (its tape kept, the failure in one line) and the next episode plays on the same agent."""
    from tests.programs import answer_of, play

    (tmp_path / "faulty_programs.py").write_text(PROCESS_PROGRAMS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("PIDFILE", str(pidfile))
    made = ProgramAgent("faulty_programs:play", SAMPLING, tokenizer, max_context=1024, sandbox=FakeSandbox(),
                        isolation="process", time_limit_s=5)  # fmt: skip
    outcomes = {}
    try:
        for seed, name in enumerate(NAMES):
            start = time.monotonic()
            tape = play(made, ScriptedLLM(tokenizer, [f"The answer is \\boxed{{{answer_of(seed)[2]}}}."]), seed=seed)
            outcomes[name] = [(tape, time.monotonic() - start)]
    finally:
        made.close()
    outcomes["good"].append(outcomes.pop("good again")[0])
    (good, _), (good_again, _) = outcomes["good"]
    assert good.metadata.error is None and good.metadata.reward == 1.0 and good_again.metadata.reward == 1.0
    steps = outcomes["steps"][0][0]
    assert steps.metadata.error is None and steps.metadata.reward == 1.25  # the environment's 1, then 0.25
    assert outcomes["exits"][0][0].metadata.error.startswith("the program raised SystemExit: 3 (")
    assert "faulty_programs.py" in outcomes["exits"][0][0].metadata.error
    assert "exited with status 4 before it returned" in outcomes["hard_exit"][0][0].metadata.error
    spun, seconds = outcomes["spins"][0]
    assert "time limit of 5 s" in spun.metadata.error and seconds < 20
    assert outcomes["floods"][0][0].metadata.reward == 1.0
    assert outcomes["leaves_a_child"][0][0].metadata.reward == 1.0
    time.sleep(0.2)
    assert not alive(int(pidfile.read_text()))
    raised = outcomes["raises"][0][0].metadata.error
    assert raised.startswith("the program raised KeyError: 'oops' (") and "faulty_programs.py:" in raised
    for name in ("exits", "hard_exit", "spins", "raises"):
        assert len(outcomes[name][0][0].llm_calls) == 1  # the tape of the failed episode is kept


def workspace_reward(tape, workspace):
    return float((workspace / "solution.py").read_text().count("def "))


def test_the_harness_options_are_checked_before_anything_starts(rl_cli):
    code, err = rl_cli(["--agent.command", "no-such-harness {prompt}"])
    assert code == 2 and "--agent.command: 'no-such-harness' is not found on PATH" in err
    code, err = rl_cli(["--agent.command", "/bin/true", "--agent.program", "agents.programs.openai_tools:play"])
    assert code == 2 and "give one of them" in err
    code, err = rl_cli(["--agent.program", "agents.programs.openai_tools:play", "--program.reward",
                        "tests.test_harness:workspace_reward"])  # fmt: skip
    assert code == 2 and "a reward of (tape, workspace) is a harness command's" in err
    code, err = rl_cli(["--program.memory_mb", "100"])
    assert code == 2 and "--program.memory_mb: is an agent program's option" in err
    code, err = rl_cli(["--agent.program", "agents.programs.openai_tools:play", "--program.isolation", "fork"])
    assert code == 2 and "--program.isolation" in err
    code, err = rl_cli(["--agent.program", "agents.programs.openai_tools:play", "--program.network", "gateway"])
    assert code == 2 and "--program.network: is a harness command's option" in err


def test_a_harness_reward_of_the_tape_and_the_workspace(tokenizer, harness):
    agent = ProgramAgent(HarnessProgram(harness("openai"), reward=workspace_reward), SAMPLING, tokenizer,
                         max_context=1024, sandbox=FakeSandbox(), time_limit_s=60)  # fmt: skip
    try:
        tape = run(agent, ScriptedLLM(tokenizer, [solved()]))
    finally:
        agent.close()
    assert tape.metadata.error is None and tape.metadata.reward == float(code_env().problem.solution.count("def "))


def test_a_harness_that_writes_its_folder_into_its_prompt_replays_identically(tokenizer, harness, harness_agent):
    """Each episode's workspace is a new folder; the harness sees it at one path (bubblewrap), so a replay asks
    what the episode asked."""
    agent = harness_agent(harness("pwd"))
    tape = run(agent, ScriptedLLM(tokenizer, [solved()]))
    assert tape.metadata.error is None and tape.metadata.reward == 1.0
    assert "Working in /tmp/tapeloop-workspace (HOME /tmp/tapeloop-workspace/.home)" in tape.llm_calls[0].prompt_text
    again = run(agent, ReplayLLM(tape, strict=True))
    assert again.metadata.error is None and again.metadata.reward == 1.0


RESPONSES_HARNESS = textwrap.dedent("""
    import os, re, openai
    client = openai.OpenAI(max_retries=0)
    stream = client.responses.create(model=os.environ["OPENAI_MODEL"], input=open("TASK.md").read(), stream=True)
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    block = re.search(r"```(?:python)?\\n(.*?)```", text, re.S)
    open("solution.py", "w").write(block.group(1) if block else text)
""")


@pytest.mark.vllm
def test_a_harness_command_trains_an_iteration_through_the_rl_loop(embedded_policy_by_url, tmp_path):
    """`--agent.command` end to end with real vLLM and the real trainer: a harness speaking the Responses API
    (streamed) on the code environment, its workspace's solution.py tested; one iteration of tapes trained."""
    from orchestrate.loop.metrics import read_metrics
    from tapes import read_tapes

    script = tmp_path / "harness.py"
    script.write_text(RESPONSES_HARNESS)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--iterations", "1", "--env.id", "code",
           "--agent.command", f"{sys.executable} {script}", "--rollouts.tasks_per_iteration", "2",
           "--rollouts.attempts", "2", "--rollouts.max_tokens", "48", "--eval.every", "0",
           "--program.time_limit_s", "120", "--server.kv_cache_gib", "1", *embedded_policy_by_url]  # fmt: skip
    import subprocess

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tapes = list(read_tapes(run / "tapes" / "iter_000001.jsonl"))
    assert len(tapes) == 4 and not any(t.metadata.error for t in tapes), [t.metadata.error for t in tapes]
    for tape in tapes:
        (output,) = [s for s in tape.steps if isinstance(s, HarnessOutput)]
        assert output.exit_code == 0 and [c.protocol for c in tape.llm_calls] == ["responses+stream"]
        assert tape.metadata.reward is not None  # the environment's tests, run on the workspace's solution.py
    metrics = read_metrics(run / "metrics.jsonl")
    assert metrics[-1]["iteration"] == 1 and (run / "checkpoints").is_dir()


def test_a_harness_whose_network_is_the_gateway_alone(tokenizer, harness, harness_agent, monkeypatch):
    """--program.network gateway: the harness reaches its model through the gateway's URL as usual, and a
    server on the machine's loopback it cannot reach; with the machine's network it can."""
    import socket

    probe = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("PROBE_PORT", str(probe.getsockname()[1]))
    try:
        outputs = {}
        for network in ("gateway", "host"):
            tape = run(harness_agent(harness("net"), network=network), ScriptedLLM(tokenizer, [solved()]))
            assert tape.metadata.error is None and tape.metadata.reward == 1.0, tape.metadata.error
            (output,) = [s for s in tape.steps if isinstance(s, HarnessOutput)]
            outputs[network] = output.text
    finally:
        probe.close()
    assert "probe: refused" in outputs["gateway"] and "probe: reached" in outputs["host"]
