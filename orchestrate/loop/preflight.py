"""What is checked before a run may start, and before anything is written to its directory.

`orchestrate.rl` refuses, with one line naming what is wrong and exit status
2, a run directory that is a file, under a file or not writable; a model that
cannot be had or a folder that holds no model; task data that is missing, of
an unknown kind, unreadable or without the fields it needs (GSM8K files, the
qa environment's questions, the search tool's corpus); options that need
what the environment does not offer (more evaluated tasks than its held-out
episodes, tools with one turn); a teacher that cannot be had, has no tokenizer, or
tokenizes otherwise than the student. Only then does
it create the run directory, take its lock and save config.json: a refused
run leaves nothing behind that would make the corrected command look like a
changed resume.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from contract.cli import OptionError
from contract.rundir import RunDir
from contract.weight_paths import select
from orchestrate.loop.policy import Policy, RunModels, checkpoint_number, first_line, model_folder, teacher_folder

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
# Suffixes that mark a value as meant to be a file (not a hub id such as "openai/gsm8k").
FILE_LIKE_SUFFIXES = (*DATA_SUFFIXES, ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".xlsx", ".yaml", ".toml")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


class PreflightError(OptionError):
    """The run cannot start; the message is one line naming the option or file."""


# -- the run directory ----------------------------------------------------------


def check_run_dir_path(root: str | os.PathLike, option: str = "--run-dir") -> None:
    """Refuse a directory that is a file, lies under a file, or cannot be written by this user."""
    root = Path(root)
    try:
        if root.exists() and not root.is_dir():
            raise PreflightError(f"{option}: {root} is a file, not a directory; pass a directory")
        existing = root
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise PreflightError(f"{option}: {root} lies under {existing}, which is a file; pass a directory path")
    except OSError as exc:  # e.g. a parent folder we may not enter
        raise PreflightError(f"{option}: {root}: {exc.strerror or exc}") from None
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(f"{option}: {existing} is not writable by this user; pass a directory you can write to")


# -- models ------------------------------------------------------------------------


def check_model(name: str, option: str) -> Path:
    """A local model folder for `name` (orchestrate.loop.policy.model_folder) that holds a model."""
    folder = model_folder(name, option)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PreflightError(f"{option}: {folder}/config.json is not readable JSON ({first_line(exc)})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise PreflightError(f"{option}: {folder}/config.json is not a Hugging Face model config (no model_type)")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise PreflightError(f"{option}: {folder} holds no weights (*.safetensors or *.bin); "
                             "point to a complete Hugging Face model folder")  # fmt: skip
    return folder


def check_teacher(teacher: str, student: Path, student_name: str, option: str = "--teacher.model",
                  what: str = "teacher") -> Path:  # fmt: skip
    """The teacher's model folder (orchestrate.loop.policy.teacher_folder), checked as a model, with a tokenizer
    that is the student's (the same vocabulary, token -> id: the teacher scores the student's token ids as they
    are) and a chat template with the student's turn markup (`chat_markup`). Templates that differ only in their
    text (Llama-3.1-8B's and Llama-3.2-1B's: the system header's date line) pass, with a note on stderr: the
    teacher reads every prompt as the student's template rendered it. `what`: "teacher", or a role's model (the
    same check: it reads prompts the policy's tokenizer rendered)."""
    folder = teacher_folder(teacher, option)
    check_model(str(folder), option)
    teacher_tok = _tokenizer(folder, f"{option} {teacher}")
    student_tok = _tokenizer(student, f"--model.policy {student_name}")
    # the teacher's words, or a role's model's (it is sent the policy's token ids, as the teacher scores them)
    ours, it = ("student", "the teacher") if what == "teacher" else ("policy", "it")
    reads = (
        "scores the student's token ids"
        if what == "teacher"
        else "is sent the token ids the policy's tokenizer rendered"
    )
    if teacher_tok.get_vocab() != student_tok.get_vocab():
        raise PreflightError(f"{option}: the {what} {teacher} ({folder}) has another vocabulary than the {ours} "
                             f"{student_name} ({student}); {it} {reads}, so give a {what} with the {ours}'s "
                             "tokenizer")  # fmt: skip
    if getattr(teacher_tok, "chat_template", None) == getattr(student_tok, "chat_template", None):
        return folder
    theirs, mine = chat_markup(teacher_tok, f"{option} {teacher}"), chat_markup(student_tok, student_name)
    if theirs != mine:
        raise PreflightError(f"{option}: the {what} {teacher} ({folder}) marks chat turns otherwise than the {ours} "
                             f"{student_name} ({student}): {' '.join(theirs) or 'no special tokens'} against "
                             f"{' '.join(mine) or 'no special tokens'}; {it} would "
                             f"{'score' if what == 'teacher' else 'read'} prompts in a markup it was not trained on, "
                             f"so give a {what} with the {ours}'s chat template")  # fmt: skip
    print(f"note: {option}: the {what}'s chat template differs from the {ours}'s in its text, not its turn markup; "
          f"{it} {'scores' if what == 'teacher' else 'reads'} each prompt as the {ours}'s template rendered it",
          file=sys.stderr)  # fmt: skip
    return folder


def check_role_model(model: str, policy: Path, policy_name: str, option: str) -> Path:
    """A role's frozen model (agent.roles: neither policy, base nor adapter), checked as a teacher is
    (check_teacher); a name that is no model is refused naming the bindings too (a misspelt one)."""
    from agents.agent import ROLE_BINDINGS
    from orchestrate.loop.policy import PolicyError

    try:
        return check_teacher(model, policy, policy_name, option, what="model")
    except PolicyError as exc:
        raise PolicyError(f"{str(exc).rstrip('.')}; or bind the role to one of {', '.join(ROLE_BINDINGS)}") from None


def check_role_server(url: str, student: Path, student_name: str, option: str, key: str) -> str:
    """A role bound to a server's URL (agent.roles): it answers, and its /tokenize turns a chat in the policy's
    markup into the token ids the policy's tokenizer does (it is sent those ids). The model name it serves."""
    import httpx

    from orchestrate.serving.launch import served_name
    from orchestrate.serving.vllm_server import ServerError

    try:
        name = served_name(url, key)
    except ServerError as exc:
        raise PreflightError(f"{option}: {exc}") from None
    tok = _tokenizer(student, f"--model.policy {student_name}")
    text = tok.apply_chat_template(MARKUP_PROBE, tokenize=False, add_generation_prompt=True)
    try:
        theirs = httpx.post(f"{url.rstrip('/')}/tokenize", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                            json={"model": name, "prompt": text, "add_special_tokens": False})  # fmt: skip
        theirs.raise_for_status()
        tokens = theirs.json()["tokens"]
    except httpx.HTTPError as exc:
        raise PreflightError(f"{option}: {url} does not answer as a vLLM server ({type(exc).__name__}: "
                             f"{first_line(exc)})") from None  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise PreflightError(f"{option}: {url} does not answer as a vLLM server ({first_line(exc)} in its answer to "
                             "/tokenize)") from None  # fmt: skip
    if tokens != tok.encode(text, add_special_tokens=False):
        raise PreflightError(f"{option}: {url} ({name}) tokenizes a chat otherwise than the policy "
                             f"{student_name}; it is sent the token ids the policy's tokenizer rendered, so serve "
                             "a model with the policy's tokenizer there")  # fmt: skip
    return name


MARKUP_PROBE = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "c"},
]


def chat_markup(tok, what: str) -> list[str]:
    """The special tokens (added tokens marked special: <|im_start|>, <|start_header_id|>, ...) that the
    tokenizer's chat template puts around a short conversation with its generation prompt, in order: how the
    model was taught to tell turns apart."""
    try:
        text = tok.apply_chat_template(MARKUP_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - no template, a template that refuses the probe: one line
        raise PreflightError(f"{what}: its chat template cannot render a conversation ({first_line(exc)})") from None
    special = {i: t.content for i, t in tok.added_tokens_decoder.items() if t.special}
    return [special[i] for i in tok(text, add_special_tokens=False)["input_ids"] if i in special]


def _tokenizer(folder: Path, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - missing files, a bad file: the same one line
        raise PreflightError(f"{what}: {folder} holds no usable tokenizer ({first_line(exc)}); give a model "
                             "folder with its tokenizer files") from None  # fmt: skip


# -- task data ------------------------------------------------------------------------


def check_gsm8k_source(value: str, split: str, option: str) -> int:
    """Load a GSM8K source as the run will; the number of tasks. Refuses what would fail later."""
    from agents.tasks import load_gsm8k

    path = Path(value).expanduser()
    if path.exists():
        if path.is_dir():
            raise PreflightError(f"{option}: {path} is a folder; give a {'/'.join(DATA_SUFFIXES)} file")
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise PreflightError(f"{option}: {path}: unknown kind of file {path.suffix or '(no extension)'!r}; "
                                 f"give a {'/'.join(DATA_SUFFIXES)} file with 'question' and 'answer' fields")  # fmt: skip
    elif path.suffix.lower() in FILE_LIKE_SUFFIXES or value.startswith((".", "/", "~")):
        raise PreflightError(f"{option}: {path} does not exist")
    import datasets

    datasets.disable_progress_bars()  # the run's console shows one line per problem, not a loader's bars
    try:
        tasks = load_gsm8k(value, split)
    except Exception as exc:  # datasets raises many kinds on a corrupt file
        raise PreflightError(f"{option}: cannot read {value} ({first_line(exc)}); give a "
                             f"{'/'.join(DATA_SUFFIXES)} file with 'question' and 'answer' fields") from None  # fmt: skip
    finally:
        datasets.enable_progress_bars()
    if not tasks:
        raise PreflightError(f"{option}: {value} holds no tasks")
    return len(tasks)


def check_qa_questions(path: str, option: str) -> int:
    """Read a qa questions file as the environment will; the number of questions."""
    from agents.envs.base import EnvError
    from agents.envs.qa import read_questions

    try:
        return len(read_questions(path))
    except EnvError as exc:
        raise PreflightError(f"{option}: {exc}") from None


def check_search_corpus(search, option: str = "--env.search.corpus") -> int:
    """Load the search tool's corpus and index (a SearchConfig) as the run will; the number of passages.
    The index built here is the one the run uses (cached beside the corpus, and in this process)."""
    from agents.search import CorpusError, load_retriever

    if not search.corpus:
        raise PreflightError(f"{option}: --env.tools search needs a corpus (JSON lines of passages)")
    try:
        return len(load_retriever(search.corpus, search.cache_dir).passages)
    except CorpusError as exc:
        raise PreflightError(f"{option}: {exc}") from None


def teacher_temperature_note(config) -> str | None:
    """The note for a teacher beside calls sampled at a temperature other than 1 (the rollouts', or the forks'
    with tree.temperature); none otherwise."""
    tempered = [(f"--{k}", t) for k, t in (("rollouts.temperature", config.rollouts.temperature),
                                            ("tree.temperature", config.tree.temperature)) if t not in (None, 1.0)]  # fmt: skip
    if not (config.teacher.model and config.teacher.coef and tempered):  # the top-k term alone is untempered
        return None
    option, t = tempered[0]
    return (f"note: --teacher.model at {option} {t}: the teacher scores untempered, the sampled log-probs are "
            "tempered, so the teacher's term pulls the tempered distribution toward the teacher (at 1.0 it is the "
            "reverse KL's estimate)")  # fmt: skip


def shared_cores_note(config, count: int | None = None) -> str | None:
    """The note for generation ahead of training (async_level) on CPU, where the servers and the learner compute
    on the same cores (config_checks.apart; `count`: the GPUs, as there); none otherwise."""
    from orchestrate.loop.config_checks import apart, visible_gpus

    gpus = len(visible_gpus()) if count is None else count
    if not config.run.async_level or gpus or apart(config, count):
        return None
    return (f"note: --run.async_level {config.run.async_level}: the policy servers and the learner share these "
            "CPU cores, where generating beside training slows both more than it hides; give each its own cores "
            "with --server.cpus and --trainer.cpus (docs/async.md#placement)")  # fmt: skip


def emulated_bf16_note(config, gpus: int | None = None, cpu_bf16: str | None | bool = False) -> str | None:
    """The note for --train.dtype bfloat16 on a CPU learner whose processor has no bf16 instructions (torch then
    emulates bf16: 26x slower than float32 on an AVX2 EPYC, bench/bench_bf16.py); none otherwise. `gpus` and
    `cpu_bf16` stand in for the machine's (contract.processor.cpu_bf16) in tests."""
    if config.train.dtype != "bfloat16":
        return None
    from orchestrate.loop.config_checks import visible_gpus

    if len(visible_gpus()) if gpus is None else gpus:
        return None
    if cpu_bf16 is False:
        from contract.processor import cpu_bf16 as processor_bf16

        cpu_bf16 = processor_bf16()
    if cpu_bf16:
        return None
    return ("note: --train.dtype bfloat16: this processor has no bf16 instructions (avx512_bf16, amx_bf16), so torch "
            "emulates bf16 and the learner runs many times slower than in float32 (docs/benchmarks.md#the-learner-"
            "in-bf16-on-cpu-benchbench_bf16py)")  # fmt: skip


def preflight(config) -> RunModels:
    """Check task data, then models, of an RLConfig: the first problem refused in one line (PreflightError, or
    orchestrate.loop.policy's PolicyError for a model that cannot be had). The run's model folders, checked,
    for its set-up."""
    if config.env.id in ("math:gsm8k", "qa"):
        from agents.envs import check_options

        options = check_options(config.env.id, config.env.options)
        if config.env.id == "qa":
            check_qa_questions(options.questions, "--env.options.questions")
        else:
            check_gsm8k_source(options.train, "train", "--env.options.train")
            check_gsm8k_source(options.test, "test", "--env.options.test")
    if "search" in config.env.tools:
        check_search_corpus(config.env.search)
    check_capabilities(config)
    check_environment(config)
    from orchestrate.loop.config_checks import servers_here

    if servers_here(config):
        check_vllm()
    models = RunModels.of(config, model=check_model,
                          teacher=lambda name, policy: check_teacher(name, policy, config.model.policy),
                          role=lambda name, policy, option: check_role_model(name, policy, config.model.policy,
                                                                             option))  # fmt: skip
    check_role_servers(config, models.policy)
    for note in (teacher_temperature_note(config), shared_cores_note(config), emulated_bf16_note(config)):
        if note:
            print(note, file=sys.stderr)
    if config.train.lora.target_modules:
        check_lora_targets(models.policy, config.train.lora.target_modules)
    check_memory(config, models.policy, teacher=models.teacher, roles=list(models.roles.values()))
    return models


def check_role_servers(config, policy: Path) -> dict[str, str]:
    """Each role bound to a server's URL answers with the policy's tokenizer (check_role_server): binding -> the
    model name it serves."""
    from orchestrate.loop.policy import role_models
    from orchestrate.serving.auth import APIKeyMissing, read_api_key

    urls = role_models(config, urls=True)
    if not urls:
        return {}
    try:
        key = read_api_key(config.server.api_key_file)
    except APIKeyMissing as exc:
        raise PreflightError(f"--agent.roles {next(iter(urls))}: {exc}") from None
    return {url: check_role_server(url, policy, config.model.policy, f"--agent.roles {role}", key)
            for role, url in urls.items()}  # fmt: skip


def check_memory(config, policy: Path, totals: list[float] | None = None,
                 teacher: Path | None = None, roles: list[Path] = ()) -> dict[str, float] | None:  # fmt: skip
    """On CPU, the run's memory plan (orchestrate.loop.memory_plan.check_cpu) fits the machine's memory (a note
    when it passes what is available now). On GPUs, it fits the GPU it is tightest on: the
    colocated servers' first, else the learner's; a teacher served here (`teacher`: its folder) has room in
    a server's share (MemoryPlanError names the phase that does not fit). `totals`: each visible GPU's GiB (for
    tests). `roles`: the folders of the frozen models roles are bound to, each a server here."""
    from orchestrate.loop.config_checks import colocated, placements, visible_gpus
    from orchestrate.loop.memory_plan import Shape, check, check_cpu, gpu_totals_gib, memory_gib

    if not visible_gpus() and totals is None:  # on CPU: the servers, the learner and this process share the memory
        from safetensors import SafetensorError

        try:
            shapes = Shape.of(policy), Shape.of(teacher) if teacher else None
            role_shapes = [Shape.of(folder) for folder in roles]
        except (OSError, ValueError, KeyError, SafetensorError):  # a folder loading will refuse, naming what is wrong
            return None
        plan, note = check_cpu(config, shapes[0], memory_gib("MemTotal"), memory_gib("MemAvailable"), teacher=shapes[1],
                               roles=role_shapes)  # fmt: skip
        if note:
            print(note, file=sys.stderr)
        return plan
    if config.trainer.launch != "local":
        return None
    totals = gpu_totals_gib() if totals is None else totals
    together = colocated(config, len(totals))
    servers, learner = placements(config)
    gpu = min(servers if together else learner)
    if gpu >= len(totals):
        return None  # check_gpus names what is not visible
    compiled = config.train.compile == "on" or (config.train.compile == "auto" and not config.trainer.accelerate_config)
    return check(config, Shape.of(policy), totals[gpu], compiled, together,
                 teacher=Shape.of(teacher) if teacher else None)  # fmt: skip


def check_vllm() -> None:
    """The installed vLLM is one our servers run on (orchestrate.serving.vllm_server.VLLM_RANGE)."""
    from orchestrate.serving.vllm_server import vllm_problem, vllm_version

    if problem := vllm_problem(vllm_version()):
        raise PreflightError(problem)


def check_lora_targets(folder: Path, targets: list[str]) -> None:
    """--train.lora.target_modules names matrices inside the policy's layers: read from its weight files'
    names (no weight is loaded)."""
    from contract.adapters import layer_projections

    names = layer_projections(folder)
    if names is None:
        return  # *.bin weights only: the learner checks when it loads the model
    if missing := [t for t in targets if t not in names]:
        raise PreflightError(f"--train.lora.target_modules: {', '.join(missing)} is not a matrix inside the layers of "
                             f"{folder.name}; those are {', '.join(names)}")  # fmt: skip


def check_capabilities(config) -> None:
    """Options that need what the environment declares (agents.envs.capabilities): no more evaluated tasks
    than its distinct held-out episodes (test_size), and a second turn where a tool call costs one. An
    environment that cannot be built is left to check_environment, which says why."""
    from agents.env_spec import EnvSpec
    from agents.envs import capabilities

    try:
        can = capabilities(EnvSpec.from_config(config, "test").make())
    except Exception:  # noqa: BLE001 - reported by check_environment
        return
    tasks, env = config.eval.tasks, f"--env.id {config.env.id}"
    if config.eval.every and tasks is not None and can.test_size is not None and tasks > can.test_size:
        raise PreflightError(f"--eval.tasks: {tasks} is more than the {can.test_size} distinct held-out episodes "
                             f"of {env} (its test_size), so some would be evaluated twice; give at most "
                             f"{can.test_size}, or leave it out to evaluate them all")  # fmt: skip
    if can.tool_calls and config.agent.max_turns < 2:
        tools = f"--env.tools {','.join(config.env.tools)}" if config.env.tools else env
        raise PreflightError(f"--agent.max_turns: {config.agent.max_turns} turn ends the episode at its first tool "
                             f"call ({tools} answers a call on the next turn); use 2 or more")  # fmt: skip


def check_environment(config) -> None:
    """The environment starts: the first train episode and the last held-out one reset without an error
    (a data set that cannot be had, options that leave fewer held-out problems than evaluated, ...)."""
    from agents.env_spec import EnvSpec
    from orchestrate.loop.evaluation import eval_size

    if EnvSpec.from_config(config, "train").uses_sandbox:  # the python tool, or an environment that runs code
        from agents.sandbox import SandboxUnavailable, check_isolation

        try:
            check_isolation(config.env.sandbox)
        except SandboxUnavailable as exc:
            raise PreflightError(f"--env.sandbox.{exc.field}: {exc}") from None
    try:
        EnvSpec.from_config(config, "train").make().reset(0)
        if config.eval.every:
            n = eval_size(config)
            EnvSpec.from_config(config, "test").make().reset(n - 1)
    except Exception as exc:  # noqa: BLE001 - whatever the environment raises, said in one line
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PreflightError(f"--env.id {config.env.id}: the environment does not start: {text}") from None


# -- servers given by URL ------------------------------------------------------------


def check_served_rank(server, option: str, rank: int) -> None:
    """A policy server by URL of a LoRA run serves adapters of `rank` (started with LoRA, a max rank as high)."""
    served = server.served_lora_rank()
    if served is None:
        raise PreflightError(f"{option}: {server.url} does not say what LoRA rank it serves, so it was not started "
                             "with `uv run -m orchestrate.serve`; start it that way")  # fmt: skip
    if served < rank:
        how = "without LoRA" if served == 0 else f"with --max-lora-rank {served}"
        raise PreflightError(f"{option}: {server.url} was started {how}, below --train.lora.rank {rank}; start it "
                             f"with `uv run -m orchestrate.serve --train.lora.rank {rank} ...`")  # fmt: skip


def check_loads_weights(server, option: str) -> None:
    """A policy server by URL of a run that trains every weight can load them: not one started with LoRA on a
    vLLM whose LoRA layers cannot (orchestrate.serving.vllm_server.LORA_RELOAD_FROM)."""
    from orchestrate.serving.vllm_server import LORA_RELOAD_FROM

    if not server.reloads_weights():
        raise PreflightError(f"{option}: {server.url} was started with LoRA on vLLM {server.vllm_version()}, which "
                             f"cannot load new weights into a server with LoRA (from {LORA_RELOAD_FROM} on); for a "
                             "run that trains every weight start it without --train.lora.rank")  # fmt: skip


def remote_server(option: str, url: str, role: str, key: str):
    """The server at `url` (a RemoteServer), checked: it answers, accepts `key`, and serves `role`'s model."""
    from orchestrate.serving.launch import remote_servers
    from orchestrate.serving.vllm_server import ServerError

    server = remote_servers([url], role=role, api_key=key)[0]
    try:
        health = server.get("/health")
        if health.status_code == 401:
            raise PreflightError(f"{option}: {url} refused the API key (HTTP 401); give the key it was started "
                                 "with (--server.api_key_file FILE, or $VLLM_API_KEY)")  # fmt: skip
        if health.status_code != 200:
            raise PreflightError(f"{option}: {url}/health answered HTTP {health.status_code}; start the server "
                                 f"with `uv run -m orchestrate.serve --role {role}`")  # fmt: skip
        server.model_root()
    except ServerError as exc:
        raise PreflightError(f"{option}: {exc}") from None
    return server


def remote_policy(url: str, key_file: str | None, option: str = "--url", key_option: str = "--key-file") -> Policy:
    """The policy server at `url`, checked (it answers, takes the key, serves 'policy'), as it serves now."""
    from orchestrate.serving.auth import read_api_key

    server = remote_server(option, url, "policy", read_api_key(key_file, option=key_option))
    root = server.model_root()
    return Policy(Path(root), checkpoint_number(Path(root)), root, note=f"the server at {url} ({root})", url=url)


def check_remote_servers(config, run_root: str | os.PathLike) -> None:
    """Each server of --server.policy_urls (and --server.reference_url when a reference pass runs) answers,
    accepts the API key, serves the expected model; a policy server sees the run's checkpoints at the paths
    this machine sends it for reloads (same folder, same files: `RemoteServer.sees`). Checked on the nearest
    folder that exists (the checkpoints of a resumed run; else the run directory's parent), and again on
    the run directory itself once it exists (the loop's start)."""
    from orchestrate.serving.auth import read_api_key
    from orchestrate.serving.vllm_server import ServerError

    s = config.server
    wanted = [("--server.policy_urls", url, "policy") for url in s.policy_urls]
    if s.reference_url and config.train.needs_reference and not config.reference_on_policy:
        wanted.append(("--server.reference_url", s.reference_url, "reference"))
    if config.teacher.url:
        wanted.append(("--teacher.model", config.teacher.url, "teacher"))
    if not wanted:
        return
    key = read_api_key(s.api_key_file)  # APIKeyMissing: one line naming --server.api_key_file
    folder = RunDir(run_root).checkpoints.resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    for option, url, role in wanted:
        server = remote_server(option, url, role, key)
        try:
            if role == "policy" and config.train.lora.rank:
                check_served_rank(server, option, config.train.lora.rank)
            elif role == "policy":
                check_loads_weights(server, option)
            # a policy server reloads weights by path, unless they come in memory (then it needs no files of ours)
            by_path = select(s.weight_transfer, config.train.lora.rank).by_path  # contract.weight_paths
            problem = server.sees(folder) if role == "policy" and by_path else None
        except ServerError as exc:
            raise PreflightError(f"{option}: {exc}") from None
        if problem:
            raise PreflightError(f"{option}: {url} cannot read the run's checkpoints: {problem}; weights are reloaded "
                                 f"by path, so mount the run directory's filesystem at the same path ({folder}) "
                                 "on that machine")  # fmt: skip
