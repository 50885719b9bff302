"""The guide keeps its promises: README.md stays short, every relative link of README.md and docs/ leads
somewhere, every file of the repository they name exists, the README's test command is the one CI runs, and
the options the docs name exist."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.loop.config import SET_BY_LOOP

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str, inline_code: bool = False) -> str:
    """The text without code: fenced blocks, indented blocks and (unless `inline_code`) inline code spans hold
    no links."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            lines.append(line)
    text = "\n".join(lines)
    return text if inline_code else re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    # a heading's inline code is part of its anchor on GitHub ("## Kill (`bench/x.py`)" -> kill-benchxpy)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", prose(page.read_text(), inline_code=True), re.MULTILINE)}


def links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text()))


def test_readme_is_guide_sized():
    size = len(README.read_bytes())
    assert size <= 20_000, f"README.md is {size} bytes; move reference material to a page under docs/"


def test_docs_exist_and_are_linked_from_the_readme():
    assert len(PAGES) > 1, "no docs/*.md"
    linked = {(README.parent / link.split("#")[0]).resolve() for link in links(README)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page):
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def readme_commands() -> list[str]:
    """The commands of the block under the README's 'two commands' heading, comments dropped."""
    text = README.read_text()
    section = re.search(r"^## [^\n]*two commands\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL | re.IGNORECASE)
    assert section, "README.md has no '## ... two commands' section"
    block = re.search(r"((?:^    \S.*\n)+)", section.group(1), re.MULTILINE)
    assert block, "the two-commands section of README.md has no command block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines()]


# A path of the repository as the pages name files: `orchestrate/loop/iteration.py`, bench/gpu/x_h200 (a stem
# its .json and .log share). Not: placeholders in capitals (NAME.py, iter_NNNNNN), globs, a run directory's own
# tapes/iter_* and tapes/eval_* files.
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tapes|agents|orchestrate|finetune|contract|tests|bench|docs)/[\w/.-]*\w)")


def named_paths(text: str) -> list[str]:
    return [
        m.group(1)
        for m in REPO_PATH.finditer(text)
        if not re.search(r"[A-Z]{3,}|\bN\b|/N\.", m.group(1))
        and not re.match(r"tapes/(iter|eval)_", m.group(1))
        and text[m.end() : m.end() + 1] != "*"  # a glob
    ]


def test_named_paths_skip_placeholders_and_run_files():
    text = "`orchestrate/loop/iteration.py`, finetune/publish/NAME.py, RUN/tapes/iter_000003.jsonl, bench/x_*.txt, tapes/store.py"
    assert named_paths(text) == ["orchestrate/loop/iteration.py", "tapes/store.py"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_files_the_docs_name_exist(page):
    """A moved or renamed file leaves no page pointing at its old place."""
    missing = [
        path
        for path in named_paths(page.read_text())
        if not (ROOT / path).exists() and not list((ROOT / path).parent.glob((ROOT / path).name + ".*"))
    ]
    assert not missing, f"{page.name} names files that do not exist: {sorted(set(missing))}"


def test_readme_test_command_is_the_one_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    ci_tests = [line for line in ci if line.startswith("uv run") and "pytest" in line]
    assert len(ci_tests) == 1, f".ci/run should run one pytest command, found {ci_tests}"
    commands = readme_commands()
    assert len(commands) == 2, f"README's set-up block should hold two commands, found {commands}"
    setup, tests = commands
    assert tests == ci_tests[0], f"README's test command {tests!r} is not .ci/run's {ci_tests[0]!r}"
    assert re.fullmatch(r"uv run -m orchestrate\.rl( --help)?", setup), f"README's first command: {setup!r}"


@pytest.fixture(scope="module")
def rl_options() -> set[str]:
    """The dotted options `orchestrate.rl --help-all` lists (the README's first command, without uv)."""
    command = [sys.executable, "-m", "orchestrate.rl", "--help-all"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(re.findall(r"^\s+(--[a-z_]+\.[a-z0-9_.]+)", out.stdout, re.MULTILINE))


def test_config_page_lists_every_option(rl_options):
    from finetune.losses import LOSSES

    listed = set(re.findall(r"`(--[a-z_]+\.[a-z0-9_.]+)`", (ROOT / "docs/config.md").read_text()))
    # a registered loss's own options (--train.LOSS.OPTION) are its options class's: --help lists them
    per_loss = {o for o in rl_options if any(o.startswith(f"--train.{name}.") for name in LOSSES)}
    missing, stale = sorted(rl_options - listed - per_loss), sorted(listed - rl_options)
    assert not missing, f"options docs/config.md does not list (add them to its table): {missing}"
    assert not stale, f"docs/config.md lists options that do not exist: {stale}"


# dotted names in the docs that are examples or placeholders, not options of orchestrate.rl; and the learner's
# fields the loop sets itself, options of orchestrate.after.offline (docs/offline.md)
NOT_OPTIONS = ("--env.options.", "--train.mine.", "--section.option", "--SECTION.OPTION",
               *(f"--{dotted}" for dotted in SET_BY_LOOP))  # fmt: skip


def test_options_named_in_the_docs_exist(rl_options):
    unknown = set()
    for page in PAGES:
        for name, wildcard in re.findall(r"(--[A-Za-z_]+\.[A-Za-z0-9_.]*[A-Za-z0-9_])(\.\*)?", page.read_text()):
            known = any(o.startswith(name + ".") for o in rl_options) if wildcard else name in rl_options
            if not name.startswith(NOT_OPTIONS) and not known:
                unknown.add(f"{page.relative_to(ROOT)}: {name}{wildcard}")
    assert not unknown, f"options named in the docs that orchestrate.rl does not have: {sorted(unknown)}"


def test_the_readme_console_line_is_what_the_loop_prints(capsys, tmp_path):
    """The example line of the README is the loop's own format (orchestrate.loop.report.Reporter.show), for the
    values it shows."""
    from contract.rundir import RunDir
    from orchestrate.loop.config import RLConfig
    from orchestrate.loop.report import Reporter

    shown = next(line.strip() for line in README.read_text().splitlines() if line.startswith("    iter 3/30 "))
    reporter = Reporter(RLConfig.model_validate({"run": {"iterations": 30}}), RunDir(tmp_path), lambda now: 0.0)
    reporter.show({
        "iteration": 3, "reward_mean": 0.25, "success_rate": 0.312, "turns_mean": 1.0, "parse_failure_rate": 0.06,
        "completion_tokens_mean": 23, "train_loss": -0.001, "trainer_busy_frac": 0.85, "generator_busy_frac": 0.12,
        "time_generate": 8.5, "time_reward": 0.1, "time_reference": 0.0, "time_train": 58.6, "time_weight_sync": 1.5,
        "time_eval": 0.0, "time_other": 0.0,
    })  # fmt: skip
    assert capsys.readouterr().out.strip() == shown


def test_the_readme_environment_example_is_an_environment(tmp_path, monkeypatch):
    """The README's own environment, as a user saves it: built by id with an option, both splits apart, the
    right answer rewarded, a wrong one not, one without \\boxed{} a format error."""
    from agents.envs import make_env

    code = re.search(r"```python\n(# my_env\.py.*?)```", README.read_text(), re.DOTALL).group(1)
    (tmp_path / "my_env.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("module:my_env:Reverse", {"length": 4}, split="train", run_seed=1)
    question, _ = env.reset(seed=7)
    word = question.split("Reverse the letters of ", 1)[1].split(".", 1)[0]
    assert len(word) == 4
    assert env.step(f"It is \\boxed{{{word[::-1]}}}")[1:3] == (1.0, True)
    env.reset(seed=7)
    assert env.step(f"\\boxed{{{word}x}}")[1] == 0.0 or word == word[::-1]
    env.reset(seed=7)
    assert env.step(word[::-1])[4] == {"success": False, "format_error": True}
    test = make_env("module:my_env:Reverse", {"length": 4}, split="test", run_seed=1)
    assert [test.reset(seed=s)[0] for s in range(5)] != [env.reset(seed=s)[0] for s in range(5)]
