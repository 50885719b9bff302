"""docs/architecture.md's "Where a new thing goes", followed to the letter in a scratch copy of the project: every
row of the table (a new loss, estimator, algorithm, tool, weight transport, environment, agent program, command
and option), each written only into the files its row names (the code as docs/training.md, docs/weights.md,
docs/environments.md and docs/programs.md show it), then the fast tests the row names, and the layering, options
and docs tests, run on the copy: green, and nothing else touched. A list kept by hand anywhere (a help text, a
test's literal, a docs table checked by a test) fails here. The recipes and the table are checked against each
other: a row without a recipe, or a recipe touching or testing files its row does not name, fails too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALWAYS = ["tests/test_layering.py", "tests/test_cli_strict.py", "tests/test_config.py", "tests/test_docs.py"]

LOSS = '''

class NearOptions(LossConfig):
    beta: float = Field(0.1, ge=0, description="weight of the squared log-ratio to the sampler")


@register_loss("near", NearOptions, paper="arXiv:0000.00000")
def near_loss(x: LossInputs, c: NearOptions) -> LossOutputs:
    """REINFORCE kept near the sampling policy by beta x the squared log-ratio."""
    pg = -x.logp * x.advantages
    drift = (x.logp - x.behaviour_logp) ** 2
    return LossOutputs(
        loss=(x.weights * (pg + c.beta * drift)).sum(),
        terms={"pg_loss": (x.weights * pg).sum().detach(), "drift": (x.weights * drift).sum().detach()},
    )
'''

ALGORITHM = """

# A recipe of its own: DAPO's clip-higher alone (no dynamic sampling, no overlong shaping).
register_algorithm(Algorithm("grpo_high", "grpo", "group", "token", "arXiv:2503.14476", "GRPO with clip-higher",
                             train={"grpo.clip_eps_high": 0.28}))  # fmt: skip
"""

ESTIMATOR = '''

@register_estimator("half", needs=("group",), paper="arXiv:0000.00000")
def half_estimator(x: Episodes) -> dict[str, dict[int, float]]:
    """Each episode's return minus a half."""
    first = x.first()  # each episode's G_0
    return x.every_turn({e: g - 0.5 for e, g in first.items()})
'''

TOOL = '''

@register_tool
class EchoTool:
    """Answers `<echo>text</echo>` with the text."""

    name = "echo"
    summary = "<echo>text</echo>, the text back as the next observation"
    runs_code = False
    stop = "</echo>"
    answered_from_tape = False

    @classmethod
    def for_spec(cls, spec, load: bool = True) -> EchoTool:
        return cls()

    def instruction(self) -> str:
        return "You may echo: write <echo>text</echo>."

    def parse(self, action: str) -> ToolCall | None:
        match = re.search(r"<echo>(.*?)</echo>", action, re.DOTALL)
        return ToolCall(self.name, match.group(1)) if match else None

    def execute(self, call: ToolCall) -> tuple[str, dict[str, Any]]:
        return call.text, {"tool": self.name}
'''

PUBLISHER = '''"""A new path for weights: the disk's folder, under another name."""

from __future__ import annotations

from pathlib import Path

from finetune.publish.base import Publisher


class CopyPublisher(Publisher):
    def write(self, learner, tmp: Path, index: int, weights: dict, keep_folder: bool) -> None:
        learner.save_weights(tmp, weights)
'''

TRANSPORT = '''"""A new path for weights: every server reloads the checkpoint's folder."""

from __future__ import annotations

from orchestrate.serving.vllm_server import VLLMServer
from orchestrate.serving.weights import Transport


class CopyTransport(Transport):
    def put(self, version: int, verify: bool, keep_previous: bool) -> list[tuple[VLLMServer, str]]:
        return self.reload_all(version, verify=verify)

    def rejoin(self, server: VLLMServer) -> None:
        self.reload(server)
'''

MECHANISM = """

register(Mechanism("copy", "finetune.publish.copy:CopyPublisher", "orchestrate.serving.transports.copy:CopyTransport",
                   summary="the disk's folder, by another name"))  # fmt: skip
"""

ENVIRONMENT = '''"""Count to a number: one turn, reward 1 for the number in \\\\boxed{}."""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict

from agents.envs.registry import register


class CountOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    high: int = 9


class CountEnv:
    def __init__(self, options: CountOptions, split: str, run_seed: int):
        self.options, self.split, self.run_seed = options, split, run_seed

    def reset(self, seed: int):
        self.target = random.Random(f"{self.split}/{self.run_seed}/{seed}").randint(1, self.options.high)
        return f"Say {self.target} in \\\\boxed{{}}.", {}

    def step(self, action: str):
        found = "\\\\boxed{" in action
        right = found and action.rsplit("\\\\boxed{", 1)[-1].split("}", 1)[0].strip() == str(self.target)
        return "", float(right), True, False, {"success": right, "format_error": not found}


@register("count:to", CountOptions, "say a number; one turn")
def make_count(options: CountOptions, split: str, run_seed: int) -> CountEnv:
    return CountEnv(options, split, run_seed)
'''


PROGRAM = '''"""The plainest agent program: the task to the model once, its reply the answer
(`--agent.program agents.programs.ask_once:play`)."""

from __future__ import annotations


async def play(task, client):
    reply = await client.chat.completions.create(
        model=task.model, messages=[{"role": "user", "content": task.observation}]
    )
    return reply.choices[0].message.content or ""
'''

COMMAND = '''"""How far a run got: `uv run -m orchestrate.after.progress RUN` prints its completed iterations."""

from __future__ import annotations

import sys

from contract.cli import StrictParser
from contract.rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    parser = StrictParser(prog="orchestrate.after.progress", allow_abbrev=False,
                          description="Print how many iterations a run has completed.")  # fmt: skip
    parser.add_argument("run_dir", help="the run directory")
    args = parser.parse_args(argv)
    print(RunDir(args.run_dir).load_state().completed_iteration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


OPTION_AT = '    max_concurrency: int = Field(64, gt=0, description="requests in flight at once, across servers")\n'
OPTION = '    note: str = Field("", description="a note kept with the run\'s settings")\n'


def append(path: str, text: str):
    return lambda root: (root / path).write_text((root / path).read_text() + text)


def write(path: str, text: str):
    return lambda root: (root / path).write_text(text)


def replace(path: str, old: str, new: str):
    def edit(root: Path) -> None:
        source = (root / path).read_text()
        assert old in source, f"{path}: {old!r} not found: the recipe no longer matches the code"
        (root / path).write_text(source.replace(old, new, 1))

    return edit


def run_module(module: str):
    """`uv run -m module` in the copy (a generator the row names, say)."""

    def edit(root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        out = subprocess.run([sys.executable, "-m", module], cwd=root, env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
        assert out.returncode == 0, f"{module}: {out.stderr[-2000:]}"

    return edit


# recipe -> (its edits, the files they may touch, the tests its row names, a check that it is in effect)
RECIPES = {
    "loss": (
        [append("finetune/losses.py", LOSS)],
        {"finetune/losses.py"},
        ["tests/test_finetune_losses.py"],
        "from finetune.losses import LOSSES; from finetune.config import TrainConfig; "
        "assert TrainConfig(loss='near').loss == 'near' and 'near' in LOSSES",
    ),
    "advantage estimator": (
        [append("finetune/estimators.py", ESTIMATOR)],
        {"finetune/estimators.py"},
        ["tests/test_estimators.py"],
        "from finetune.config import TrainConfig; assert TrainConfig(estimator='half').estimator == 'half'",
    ),
    "algorithm": (
        [append("finetune/algorithms.py", ALGORITHM)],
        {"finetune/algorithms.py"},
        [
            "tests/test_config.py",
            "tests/test_finetune_learner.py::test_every_registered_algorithm_trains_as_the_command_line_resolves_it"
            "[grpo_high]",
            "tests/test_compare_algorithms.py::test_every_registered_algorithm_is_a_recipe_and_sets_what_its_paper_does",
        ],
        "from orchestrate.loop.command_line import resolve; c = resolve('embedded', {'train.algorithm': 'grpo_high'}); "
        "assert c.train.grpo.clip_eps_high == 0.28 and c.train.loss == 'grpo' and not c.rollouts.dynamic_sampling",
    ),  # fmt: skip
    "tool": (
        [append("agents/tools.py", TOOL)],
        {"agents/tools.py"},
        ["tests/test_tools.py"],
        "from orchestrate.loop.command_line import resolve; c = resolve('embedded', {'env.tools': 'echo', "
        "'agent.max_turns': '2'}); from agents.env_spec import EnvSpec; "
        "assert EnvSpec.from_config(c, 'train').make().tools[0].name == 'echo'",
    ),
    "weight transport": (
        [
            write("finetune/publish/copy.py", PUBLISHER),
            write("orchestrate/serving/transports/copy.py", TRANSPORT),
            append("contract/weight_paths.py", MECHANISM),
        ],  # fmt: skip
        {"finetune/publish/copy.py", "orchestrate/serving/transports/copy.py", "contract/weight_paths.py"},
        ["tests/test_weight_paths.py"],
        "from orchestrate.loop.command_line import resolve; from contract.weight_paths import load, select; "
        "c = resolve('embedded', {'server.weight_transfer': 'copy'}); m = select(c.server.weight_transfer); "
        "assert load(m.publisher).__name__ == 'CopyPublisher' and load(m.transport).__name__ == 'CopyTransport'",
    ),
    "environment": (
        [
            write("agents/envs/count.py", ENVIRONMENT),
            replace("agents/envs/registry.py", '"gem"):', '"gem", "count"):'),
        ],  # fmt: skip
        {"agents/envs/count.py", "agents/envs/registry.py"},
        ["tests/test_envs.py"],
        "from orchestrate.loop.command_line import resolve; c = resolve('embedded', {'env.id': 'count:to'}); "
        "from agents.env_spec import EnvSpec; assert 'Say' in EnvSpec.from_config(c, 'test').make().reset(0)[0]",
    ),
    "agent program": (
        [write("agents/programs/ask_once.py", PROGRAM)],
        {"agents/programs/ask_once.py"},
        [
            "tests/test_gateway.py::test_every_shipped_program_answers_a_task_through_the_gateway",
            "tests/test_gateway.py::test_a_program_path_of_the_wrong_shape_is_refused_in_one_line",
        ],
        "from orchestrate.loop.command_line import resolve; c = resolve('embedded', {'agent.program': "
        "'agents.programs.ask_once:play'}); from agents.program import load_program; "
        "assert load_program(c.agent.program).__name__ == 'play'",
    ),  # fmt: skip
    "command": (
        [write("orchestrate/after/progress.py", COMMAND)],
        {"orchestrate/after/progress.py"},
        ["tests/test_cli_errors.py::test_an_unknown_option_is_one_line_not_the_whole_usage", "tests/test_layering.py"],
        "import tempfile; out = subprocess.run([sys.executable, '-m', 'orchestrate.after.progress', "
        "tempfile.mkdtemp()], capture_output=True, text=True); assert out.returncode == 0 and out.stdout == '0\\n', out",
    ),  # fmt: skip
    "option": (
        [
            replace("orchestrate/loop/config.py", OPTION_AT, OPTION_AT + OPTION),
            run_module("orchestrate.loop.config_doc"),
        ],
        {"orchestrate/loop/config.py", "docs/config.md"},
        ["tests/test_cli_strict.py", "tests/test_config.py"],
        "from orchestrate.loop.command_line import resolve; "
        "assert resolve('embedded', {'rollouts.note': 'kept'}).rollouts.note == 'kept'; "
        "assert '--rollouts.note' in open('docs/config.md').read()",
    ),
}


def table_rows() -> dict[str, dict[str, str]]:
    """docs/architecture.md's "Where a new thing goes": {a new thing (without its parenthesis): {column: cell}}."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page.split("## Where a new thing goes", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
        rows[re.sub(r"\s*\(.*\)$", "", cells["a new"])] = cells
    return rows


def named_paths(cell: str) -> list[str]:
    """The paths a cell of the table names (`code` with a slash): a folder ends with /, NAME and PKG stand for any."""
    return [p for p in re.findall(r"`([^`\s]+)`", cell) if "/" in p]


def named_by(path: str, patterns: list[str]) -> bool:
    return any(path.startswith(p) if p.endswith("/") else fnmatch(path, re.sub(r"NAME|PKG", "*", p)) for p in patterns)


def test_the_recipes_follow_every_row_of_the_table_and_touch_and_test_only_what_it_names():
    """Each row of the table has its recipe here; a recipe writes only files its row's "where" and "registered by"
    name, and runs tests its row's "its test" names, all of them."""
    rows = table_rows()
    assert set(rows) == set(RECIPES), f"rows without a recipe: {set(rows) - set(RECIPES)}; " \
                                      f"recipes without a row: {set(RECIPES) - set(rows)}"  # fmt: skip
    for name, (_edits, allowed, tests, _check) in RECIPES.items():
        row = rows[name]
        where = named_paths(row["where"]) + named_paths(row["registered by"])
        assert all(named_by(path, where) for path in allowed), (name, allowed, where)
        named_tests = named_paths(row["its test"])
        files = {test.split("::")[0] for test in tests}
        assert all(named_by(f, named_tests) for f in files), (name, files, named_tests)
        assert all(any(named_by(f, [p]) for f in files) for p in named_tests), (name, files, named_tests)


def scratch_copy(into: Path) -> dict[str, bytes]:
    """The project's files (tracked, or new and not ignored; as they are in the working tree) copied to `into`;
    {path: content}."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout  # fmt: skip
    contents = {}
    for name in files.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            contents[name] = source.read_bytes()
    return contents


def files_of(root: Path) -> dict[str, bytes]:
    """{path: content} of the copy's files as they are now."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()
            and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts}  # fmt: skip


def changed(root: Path, before: dict[str, bytes]) -> set[str]:
    now = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
           and ".pytest_cache" not in p.parts}  # fmt: skip
    return {p for p in now if p not in before or (root / p).read_bytes() != before[p]} | (set(before) - now)


@pytest.mark.slow
def test_each_recipe_touches_only_its_files_and_the_suite_stays_green_with_all_of_them(tmp_path):
    """The recipes applied one after another to one copy: each touches only its row's files (checked after each),
    each is in effect, and the tests their rows name pass with all of them in (one run of the fast tests: a run per
    recipe cost a start of the same test files each)."""
    root = tmp_path / "repo"
    scratch_copy(root)
    for recipe, (edits, allowed, _tests, _check) in RECIPES.items():
        before = files_of(root)  # with the recipes before it in: this one's own changes are compared
        for edit in edits:
            edit(root)
        assert changed(root, before) == allowed, f"the {recipe} recipe touched other files"
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    checks = "; ".join(check for *_, check in RECIPES.values())
    where = subprocess.run([sys.executable, "-c", f"import subprocess, sys, orchestrate, agents; "
                            f"print(orchestrate.__file__); {checks}"],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.startswith(str(root)), f"the copy's modules were not the ones imported: {where.stdout}"
    tests = list(dict.fromkeys([*(t for _, _, row_tests, _ in RECIPES.values() for t in row_tests), *ALWAYS]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
                          "not vllm and not slow", *tests], cwd=root, env=env, capture_output=True,
                         text=True, timeout=1200)  # fmt: skip
    assert out.returncode == 0, f"the recipes leave the suite failing:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
