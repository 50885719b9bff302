"""docs/architecture.md's "Where a new thing goes", followed to the letter in a scratch copy of the project: a new
loss, estimator, tool, weight transport and environment, each written only into the files its row names
(the code as docs/training.md, docs/weights.md and docs/environments.md show it), then the fast tests the row
names, and the layering, options and docs tests, run on the copy: green, and nothing else touched. A list
kept by hand anywhere (a help text, a test's literal, a docs table checked by a test) fails here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


# recipe -> (its edits, the files they may touch, the tests its row names, a check that it is in effect)
RECIPES = {
    "loss": (
        [append("finetune/losses.py", LOSS)],
        {"finetune/losses.py"},
        ["tests/test_finetune_losses.py"],
        "from finetune.losses import LOSSES; from finetune.config import TrainConfig; "
        "assert TrainConfig(loss='near').loss == 'near' and 'near' in LOSSES",
    ),
    "estimator": (
        [append("finetune/estimators.py", ESTIMATOR)],
        {"finetune/estimators.py"},
        ["tests/test_estimators.py"],
        "from finetune.config import TrainConfig; assert TrainConfig(estimator='half').estimator == 'half'",
    ),
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
}


def scratch_copy(into: Path) -> dict[str, bytes]:
    """The project's tracked files (as they are in the working tree) copied to `into`; {path: content}."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
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
    """The five recipes applied one after another to one copy: each touches only its row's files (checked after
    each), each is in effect, and the tests their rows name pass with all five in (one run of the fast tests: a
    run per recipe cost five starts of the same test files)."""
    root = tmp_path / "repo"
    scratch_copy(root)
    for recipe, (edits, allowed, _tests, _check) in RECIPES.items():
        before = files_of(root)  # with the recipes before it in: this one's own changes are compared
        for edit in edits:
            edit(root)
        assert changed(root, before) == allowed, f"the {recipe} recipe touched other files"
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    checks = "; ".join(check for *_, check in RECIPES.values())
    where = subprocess.run([sys.executable, "-c", f"import orchestrate, agents; print(orchestrate.__file__); {checks}"],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.startswith(str(root)), f"the copy's modules were not the ones imported: {where.stdout}"
    tests = list(dict.fromkeys(t for _, _, row_tests, _ in RECIPES.values() for t in row_tests))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
                          "not vllm and not slow", *tests, *ALWAYS], cwd=root, env=env, capture_output=True,
                         text=True, timeout=1200)  # fmt: skip
    assert out.returncode == 0, f"the recipes leave the suite failing:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
