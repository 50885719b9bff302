r"""The layering rules (README.md, "Layout"; docs/architecture.md), checked on the source: every module's imports,
parsed (ast).

    tapes  <-  agents  <-  orchestrate  --(subprocess, files)-->  finetune
                                 \                                /
                                  '-------->  contract  <--------'

and inside orchestrate, one way too:

    orchestrate (the commands that run models: rl, serve, eval)
    orchestrate.after (the commands on a run's results: browse, show, replay, fork, offline, merge)
        -> orchestrate.loop (one RL run: config, rollouts, the learner's process, metrics)
            -> orchestrate.gateway (agent programs of the user's own, through an OpenAI-compatible API)
            -> orchestrate.serving (vLLM servers, the client, model lookup, weights to servers)
                <- orchestrate.serving.vllm_plugin (code that runs inside vLLM's processes: vLLM loads it,
                   nothing of ours imports it; it uses serving's auth names)

tapes is the bottom layer and imports nothing of ours; agents builds on tapes only; contract (what the two
processes share: the run directory's names, the batch format, durable writes, the command-line generator,
KL) imports nothing of ours; finetune uses contract only (it runs as its own process); orchestrate may use
all of them; nothing imports orchestrate (tests and bench may). Imports inside functions and under
`if TYPE_CHECKING` count too: a lazy import is still an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tapes", "contract", "agents", "orchestrate", "finetune")

# The places whose imports are ruled, and what each may import of ours besides itself. A module's place is the
# longest of these names its own dotted name starts with; so is an imported module's.
ALLOWED = {
    "tapes": set(),
    "contract": set(),
    "agents": {"tapes"},
    "finetune": {"contract"},
    "orchestrate.serving.vllm_plugin": {"contract", "orchestrate.serving"},
    "orchestrate.serving": {"tapes", "contract"},  # vLLM loads the plugin; nothing of ours imports it
    "orchestrate.gateway": {"tapes", "contract", "agents", "orchestrate.serving"},
    "orchestrate.loop": {"tapes", "contract", "agents", "finetune", "orchestrate.gateway", "orchestrate.serving"},
    "orchestrate": {"tapes", "contract", "agents", "finetune", "orchestrate.loop", "orchestrate.gateway",
                    "orchestrate.serving"},
    "orchestrate.after": {"tapes", "contract", "agents", "finetune", "orchestrate.loop", "orchestrate.gateway",
                          "orchestrate.serving"},
}  # fmt: skip


def place(module: str) -> str | None:
    """The ruled place of a dotted module name (None: not ours)."""
    matches = [p for p in ALLOWED if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def imported_modules(source: str, own: str) -> set[tuple[int, str]]:
    """(line, dotted module) for each module of ours that `source` imports: `import x.y`, `from x.y import z`
    (x.y.z when z is a module, else x.y: both lie in one place unless z is a package of its own), and
    importlib.import_module("x...") with a literal (or f-string) name; a relative import is `own`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = own if node.level else (node.module or "")
            names = [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value.rstrip(".")]
        for name in names:
            if name.split(".")[0] in PACKAGES:
                found.add((node.lineno, name))
    return found


def test_the_checker_sees_every_kind_of_import():
    source = (
        "import tapes.tape\n"
        "from contract.kl import k3\n"
        "def f():\n"
        "    from orchestrate.loop import iteration\n"
        "    import importlib\n"
        "    importlib.import_module(f'agents.envs.{name}')\n"
        "from . import sibling\n"
        "import torch, json\n"
    )
    found = imported_modules(source, own="tapes")
    assert {(line, place(name)) for line, name in found} == {
        (1, "tapes"), (2, "contract"), (4, "orchestrate.loop"), (6, "agents"), (7, "tapes")}  # fmt: skip


def test_places_nest():
    assert place("orchestrate.serving.vllm_plugin.weight_engine") == "orchestrate.serving.vllm_plugin"
    assert place("orchestrate.serving.llm") == "orchestrate.serving"
    assert place("orchestrate.rl") == "orchestrate" and place("orchestrate") == "orchestrate"
    assert place("orchestrate_other") is None and place("torch") is None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_one_way(package):
    """A module imports only what its place may: a back-edge names the file and line to move."""
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules under {package}/"
    wrong = []
    for path in files:
        own = place(module_name(path))
        package_of = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
        for line, name in sorted(imported_modules(path.read_text(encoding="utf-8"), own=package_of)):
            there = place(name)
            if there != own and there not in ALLOWED[own]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {name} ({there})")
    assert not wrong, "imports against the layering: " + "; ".join(wrong)


# What the orchestrator takes from the learner's package: the training options it resolves and hands over, and
# the registries and formulas it reads or applies the same way (one source each); never the learner itself.
FINETUNE_FOR_ORCHESTRATE = ("finetune.config", "finetune.algorithms", "finetune.estimators")


def test_the_orchestrator_takes_only_options_and_formulas_from_finetune():
    wrong = []
    for path in sorted((ROOT / "orchestrate").rglob("*.py")):
        for line, name in sorted(imported_modules(path.read_text(encoding="utf-8"), own="orchestrate")):
            if name.split(".")[0] == "finetune" and not any(
                name == m or name.startswith(m + ".") for m in FINETUNE_FOR_ORCHESTRATE
            ):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not wrong, f"orchestrate may import of finetune only {FINETUNE_FOR_ORCHESTRATE}: " + "; ".join(wrong)


def commands() -> set[str]:
    """Every command's module: a module of orchestrate/ or orchestrate/after/ with a `main()`."""
    found = set()
    for folder in (ROOT / "orchestrate", ROOT / "orchestrate" / "after"):
        for path in folder.glob("*.py"):
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(path.read_text()).body):
                found.add(module_name(path))
    return found


def test_no_command_imports_another():
    """What two commands share lives in a module that is not a command (orchestrate/loop/setup.py, say)."""
    names = commands()
    assert {"orchestrate.rl", "orchestrate.after.browse", "orchestrate.after.fork"} <= names
    wrong = []
    for name in sorted(names):
        path = ROOT / (name.replace(".", "/") + ".py")
        for line, other in sorted(imported_modules(path.read_text(encoding="utf-8"), own=name.rpartition(".")[0])):
            if other != name and any(other == c or other.startswith(c + ".") for c in names):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {other}")
    assert not wrong, "a command imports another command's module: " + "; ".join(wrong)


def loop_imports() -> dict[str, set[str]]:
    """Each module of orchestrate/loop/ and the modules of orchestrate/loop/ it imports (lazy ones included)."""
    folder = ROOT / "orchestrate" / "loop"
    modules = {module_name(path) for path in folder.glob("*.py") if path.name != "__init__.py"}
    edges = {}
    for name in modules:
        source = (folder / (name.rpartition(".")[2] + ".py")).read_text(encoding="utf-8")
        found = {other for _, other in imported_modules(source, own="orchestrate.loop")}
        # `from orchestrate.loop.x import y` reads as orchestrate.loop.x.y: the module is the longest one named
        edges[name] = {m for m in modules if m != name and any(o == m or o.startswith(m + ".") for o in found)}
    return edges


def circles(edges: dict[str, set[str]]) -> list[str]:
    """Each import `a -> b` where b leads back to a, directly or through others."""

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for other in edges.get(todo.pop(), set()) - seen:
                seen.add(other)
                todo.append(other)
        return seen

    return sorted(f"{a} -> {b} -> ... -> {a}" for a in edges for b in edges[a] if a in reaches(b))


def test_no_module_of_the_loop_imports_one_that_imports_it_back():
    """Inside orchestrate/loop/ imports run one way: no module imports another that imports it back, directly or
    through others (what two need of each other goes into a module below both, as orchestrate/loop/policy.py
    holds the policy resolution for the checks and the set-up)."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        "a -> b -> ... -> a", "b -> c -> ... -> b", "c -> a -> ... -> c"]  # fmt: skip
    edges = loop_imports()
    assert "orchestrate.loop.config_checks" in edges["orchestrate.loop.preflight"]  # a lazy import counts
    assert "orchestrate.loop.policy" in edges["orchestrate.loop.preflight"] & edges["orchestrate.loop.setup"]
    found = circles(edges)
    assert not found, "modules of orchestrate/loop/ that import each other: " + "; ".join(found)


def test_every_package_is_covered():
    """A new top-level package needs its rule here before it can be imported from."""
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert ours == set(PACKAGES), f"packages without a layering rule: {sorted(ours - set(PACKAGES))}"


def test_reading_the_options_loads_no_torch():
    """Every command line reads the option registries (losses, estimators); `--help` and a bad option refused
    in one line must not wait seconds for torch (finetune/lazy.py)."""
    code = "import sys, orchestrate.loop.config, finetune.config; print('torch._C' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_architecture_page_draws_every_place():
    """docs/architecture.md's picture of the packages names every place ruled here: a new place is drawn."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    picture = page.split("## The packages and their arrows", 1)[1].split("\n## ", 1)[0]
    missing = [p for p in ALLOWED if p.replace(".", "/") + "/" not in picture]
    assert not missing, f"docs/architecture.md's picture does not name {missing}"


def test_servers_are_built_and_called_in_serving_only():
    """One run set-up (orchestrate/loop/setup.py, building servers with orchestrate/serving/launch.py): no module
    outside orchestrate/serving/ constructs a vLLM server or calls a server's private methods."""
    wrong = []
    for path in sorted((ROOT / "orchestrate").rglob("*.py")):
        if (ROOT / "orchestrate" / "serving") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
            private = isinstance(node.func, ast.Attribute) and name.startswith("_") and not name.startswith("__")
            if name in ("VLLMServer", "RemoteServer") or (private and name in ("_post", "_get")):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(...)")
    assert not wrong, "servers built or called outside orchestrate/serving/: " + "; ".join(wrong)
