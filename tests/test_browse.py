"""The tape browser (`python -m tapes.browse`) driven in a real headless chromium, and the terminal view.

The page is checked for what a user sees: the run's config and curves, the tape list and its
filters, sorting and paging, one tape with its steps, prompt and coloured output tokens, and its
GRPO group with advantages. Most tests use the tapes of a real 2-iteration run on the tiny model
(the session fixture `tiny_run`); the 10,000-tape test makes its tapes.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tapes.browse import group_advantages, serve
from tapes.store import read_tapes, write_tapes
from tapes.tape import FinalAnswerAction, LLMCall, ParseFailureStep, ReasoningThought, SamplingParams, Tape, TaskStep

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install chromium`; .ci/run does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )  # fmt: skip
        yield browser
        browser.close()


def start_server(run_dir, **kw):
    server = serve(run_dir, port=0, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.errors = errors
    yield page
    context.close()
    assert not errors, errors  # no script error while the user clicked around


def rows(page):
    return page.locator("#rows tr[data-file]")


def act(page, action):
    """Do something that reloads the tape list, and wait until the new list is on the page."""
    version = page.locator("#rows").get_attribute("data-version")
    action()
    page.wait_for_function(f"document.querySelector('#rows').dataset.version !== {json.dumps(version)}")


def open_page(page, url):
    page.goto(url)
    page.wait_for_function("document.querySelector('#rows').dataset.version !== undefined")


def choose(page, select, value):
    act(page, lambda: page.select_option(select, value))


def type_in(page, field, text):
    act(page, lambda: page.fill(field, text))


def wait_rows(page, count):
    assert rows(page).count() == count


def column(page, css):
    return [c.inner_text() for c in page.locator(f"#rows tr[data-file] td.{css}").all()]


# -- a real run --------------------------------------------------------------------------------


vllm = pytest.mark.vllm  # these use the real run made by the `tiny_run` fixture


@vllm
def test_browse_a_real_run(tiny_run, page):
    tapes = {i: list(read_tapes(tiny_run / "tapes" / f"iter_{i:06d}.jsonl")) for i in (1, 2)}
    server, url = start_server(tiny_run)
    try:
        page.goto(url)
        # the run: its folder, its config, one curve per metric with a point per iteration
        page.locator("svg.chart").first.wait_for()
        assert str(tiny_run.resolve()) in page.locator("header").inner_text()
        page.locator("#config summary").click()
        config = page.locator("#config-json").inner_text()
        assert json.loads(config)["rollouts"]["attempts"] == 4
        reward_chart = page.locator("svg[data-metric=reward_mean]")
        assert reward_chart.locator("circle.point").count() == 2  # iterations 1 and 2
        assert page.locator("svg[data-metric=eval_success_rate] circle.point").count() == 2  # evals at 0 and 2

        # clicking the point of iteration 2 lists the tapes of iteration 2
        act(page, lambda: reward_chart.locator("circle[data-iteration='2']").click())
        wait_rows(page, 8)
        assert "iteration 2" in page.locator("#list-title").inner_text()
        assert {r.locator("td").nth(1).inner_text() for r in rows(page).all()} == {"2"}
        assert page.locator("#page-info").inner_text() == "1–8 of 8"

        # or a row of the iteration table: iteration 0 is the evaluation before training
        metrics = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
        table = page.locator("#iteration-rows tr")
        assert table.count() == 3
        assert table.nth(1).locator("td").nth(1).inner_text() == f"{metrics[1]['reward_mean']:.3f}"
        act(page, lambda: table.nth(0).click())
        assert page.locator("#f-kind").input_value() == "eval" and rows(page).count() == 4
        act(page, lambda: table.nth(2).click())
        wait_rows(page, 8)

        # filters: reward, task, parse failure, truncation -- counts as in the files
        choose(page, "#f-reward", "<0")
        wait_rows(page, sum(t.metadata.reward < 0 for t in tapes[2]))
        choose(page, "#f-reward", ">0")
        wait_rows(page, sum(t.metadata.reward > 0 for t in tapes[2]))
        choose(page, "#f-reward", "")
        task = tapes[2][0].metadata.task_id
        type_in(page, "#f-task", task)
        wait_rows(page, sum(t.metadata.task_id == task for t in tapes[2]))
        assert {r.locator("td").nth(2).inner_text() for r in rows(page).all()} == {task}
        type_in(page, "#f-task", "")
        wait_rows(page, 8)
        for flag, select in (("parse_failure", "#f-parse"), ("truncated", "#f-trunc")):
            expected = {
                "parse_failure": sum(isinstance(t.steps[-1], ParseFailureStep) for t in tapes[2]),
                "truncated": sum(any(c.finish_reason == "length" for c in t.llm_calls) for t in tapes[2]),
            }[flag]
            choose(page, select, "yes")
            wait_rows(page, expected)
            choose(page, select, "no")
            wait_rows(page, 8 - expected)
            choose(page, select, "")
            wait_rows(page, 8)

        # sorted by length, longest first
        choose(page, "#f-iteration", "")
        wait_rows(page, 16)
        choose(page, "#f-sort", "-length")
        lengths = [int(x) for x in column(page, "length")]
        assert lengths == sorted((sum(len(c.output_token_ids) for c in t.llm_calls) for t in tapes[1] + tapes[2]),
                                 reverse=True)  # fmt: skip

        # paged: 16 tapes, 25 per page on one page; evaluation tapes listed apart
        choose(page, "#f-kind", "eval")
        wait_rows(page, 8)
        choose(page, "#f-kind", "rollout")
        choose(page, "#f-sort", "")
        wait_rows(page, 16)

        # one tape: steps in order, the prompt, output tokens coloured by log-prob, then by KL
        tape = tapes[1][5]
        page.locator("#rows tr[data-file='iter_000001.jsonl'][data-index='5']").click()
        page.locator("#tape-head").wait_for()
        head = page.locator("#tape-head").inner_text()
        assert tape.metadata.id in head and tape.metadata.reward_reason in head
        assert f"reward {tape.metadata.reward:.1f}" in head
        kinds = [k.inner_text() for k in page.locator("#steps .kind").all()]
        assert kinds == [f"{i}. {s.kind}" for i, s in enumerate(tape.steps, start=1)]
        call = tape.llm_calls[0]
        prompt = page.locator(".call .prompt").inner_text()
        assert tape.steps[0].text in prompt
        tokens = page.locator(".call .tokens .tok")
        assert tokens.count() == len(call.output_token_ids)
        titles = [t.get_attribute("title") for t in tokens.all()]
        assert [int(re.match(r"token (\d+):", t).group(1)) for t in titles] == call.output_token_ids
        first = tokens.first
        assert f"log-prob {call.logprobs[0]:.4f}" in first.get_attribute("title")
        by_logprob = [t.evaluate("e => e.style.backgroundColor") for t in tokens.all()]
        assert len(set(by_logprob)) > 1  # tokens of different log-probs look different
        page.get_by_role("radio", name=re.compile("KL to reference")).check()
        ref = call.ref_logprobs
        kl0 = math.exp(ref[0] - call.logprobs[0]) - (ref[0] - call.logprobs[0]) - 1
        first = page.locator(".call .tokens .tok").first
        assert f"KL {kl0:.4f}" in first.get_attribute("title")
        by_kl = [t.evaluate("e => e.style.backgroundColor") for t in page.locator(".call .tokens .tok").all()]
        assert by_kl != by_logprob

        # the address links to the tape: opened anew, the page shows it again
        assert page.url.endswith("#tape=iter_000001.jsonl:5")
        page.reload()
        page.wait_for_function(f"document.querySelector('#tape-head')?.innerText.includes({json.dumps(tape.metadata.id)})")

        # its group, side by side, with advantages as the learner computes them
        attempts = page.locator("#group-body .attempt")
        group = [t for t in tapes[1] if t.metadata.group_id == tape.metadata.group_id]
        assert attempts.count() == len(group) == 4
        page.wait_for_function("![...document.querySelectorAll('#group-body .output')].some(e => e.textContent === '…')")
        outputs = [a.locator(".output").inner_text() for a in attempts.all()]
        assert outputs == [t.llm_calls[0].output_text for t in group]
    finally:
        server.shutdown()


@vllm
def test_group_view_shows_advantages(tiny_run, tmp_path, page):
    """Rewards differ within a group (set here on a copy of the run): the page shows the GRPO advantages."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("checkpoints", "batches", "logs"))
    path = run / "tapes" / "iter_000001.jsonl"
    tapes = list(read_tapes(path))
    rewards = [1.0, 0.0, -1.0, -1.0, 1.0, 1.0, 1.0, 0.0]
    for tape, r in zip(tapes, rewards):
        tape.metadata.reward = r
    path.unlink()
    write_tapes(path, tapes)
    expected = group_advantages(rewards[:4]) + group_advantages(rewards[4:])
    assert any(abs(a) > 0.1 for a in expected)

    server, url = start_server(run)
    try:
        open_page(page, url)
        act(page, lambda: page.locator("a.file-link", has_text="iter_000001.jsonl").click())
        wait_rows(page, 8)
        assert [float(r.locator("td").nth(4).inner_text()) for r in rows(page).all()] == pytest.approx(
            expected, abs=0.006
        )
        choose(page, "#f-sort", "-reward")
        assert [float(x) for x in column(page, "reward")] == sorted(rewards, reverse=True)
        choose(page, "#f-sort", "")
        wait_rows(page, 8)
        rows(page).nth(1).click()
        page.locator("#tape-head").wait_for()
        shown = [float(a.inner_text()) for a in page.locator("#group-body .attempt .advantage").all()]
        assert shown == pytest.approx(expected[:4], abs=0.0006)
        assert page.locator("#group-body .attempt.current").inner_text().startswith("#1")
        page.locator("#group-body .attempt").nth(0).click()  # open another attempt from the group
        page.wait_for_function("document.querySelector('#tape-head').innerText.includes('#0')")
        assert "reward 1.0" in page.locator("#tape-head").inner_text()
    finally:
        server.shutdown()


# -- big runs, the command lines ------------------------------------------------------------------


def synthetic_tape(i: int, iteration: int) -> Tape:
    n = 5 + i % 40
    call = LLMCall(
        model="synthetic", messages=[{"role": "user", "content": f"What is {i} + 1?"}], prompt_token_ids=[1, 2, 3],
        output_text="x" * n, output_token_ids=[7] * n, logprobs=[-0.1 * (k % 7) for k in range(n)],
        ref_logprobs=[-0.2] * n, finish_reason="length" if i % 9 == 0 else "stop",
        sampling=SamplingParams(temperature=0.7),
    )  # fmt: skip
    tape = Tape()
    tape.metadata.task_id, tape.metadata.group_id = f"task-{i // 4}", f"{iteration}:task-{i // 4}"
    tape.metadata.iteration, tape.metadata.reward = iteration, float(i % 3 - 1)
    tape.append(TaskStep(text=f"What is {i} + 1?"))
    if i % 5 == 0:
        tape.append(ParseFailureStep(error="no \\boxed{} answer", output=call.output_text), llm_call=call)
    else:
        tape.append(ReasoningThought(reasoning="x"), llm_call=call)
        tape.append(FinalAnswerAction(answer=str(i + 1)), llm_call=call)
    return tape


def test_browse_stays_responsive_with_10000_tapes(tmp_path, page):
    run = tmp_path / "big"
    (run / "tapes").mkdir(parents=True)
    for iteration in range(1, 6):
        write_tapes(run / "tapes" / f"iter_{iteration:06d}.jsonl", (synthetic_tape(i, iteration) for i in range(2000)))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "reward_mean": 0.1 * i}) + "\n"
                                               for i in range(1, 6)))  # fmt: skip
    (run / "config.json").write_text("{}")
    server, url = start_server(run)
    try:
        start = time.perf_counter()
        open_page(page, url)
        wait_rows(page, 50)
        first_load = time.perf_counter() - start
        assert page.locator("#page-info").inner_text() == "1–50 of 10000"
        assert first_load < 15, f"first page took {first_load:.1f} s (indexes 10,000 tapes)"

        # later requests use the index: each page and filter answers quickly
        for action in (
            lambda: page.click("#next"),
            lambda: page.select_option("#f-parse", "yes"),
            lambda: page.select_option("#f-sort", "-length"),
        ):
            start = time.perf_counter()
            act(page, action)
            assert time.perf_counter() - start < 2
        assert page.locator("#page-info").inner_text() == "1–50 of 2000"  # every 5th tape is a parse failure
        lengths = [int(x) for x in column(page, "length")]
        assert lengths == sorted(lengths, reverse=True) and lengths[0] == max(5 + i % 40 for i in range(0, 2000, 5))

        # the last tape of the last file opens as fast as the first
        choose(page, "#f-parse", "")
        choose(page, "#f-sort", "")
        choose(page, "#f-limit", "100")
        wait_rows(page, 100)
        for _ in range(3):  # a few pages on
            act(page, lambda: page.click("#next"))
        assert page.locator("#page-info").inner_text() == "301–400 of 10000"
        start = time.perf_counter()
        rows(page).last.click()
        page.wait_for_function("document.querySelector('#tape-head') && document.querySelector('#tape-head').innerText.includes('#399')")
        assert time.perf_counter() - start < 2
    finally:
        server.shutdown()

    # the API pages through the last file without reading it whole
    server, url = start_server(run)
    try:
        body = httpx.get(url + "api/tapes", params={"iteration": 5, "offset": 1990, "limit": 50}).json()
        assert body["total"] == 2000 and [s["index"] for s in body["items"]] == list(range(1990, 2000))
        tape = httpx.get(url + "api/tape", params={"file": "iter_000005.jsonl", "index": 1999}).json()
        assert tape["steps"][0]["text"] == "What is 1999 + 1?"
        assert httpx.get(url + "api/tape", params={"file": "../config.json", "index": 0}).status_code == 404
    finally:
        server.shutdown()


def test_browse_command_prints_its_address_and_refuses_a_non_run(tmp_path):
    run = tmp_path / "run"
    write_tapes(run / "tapes" / "iter_000001.jsonl", [synthetic_tape(i, 1) for i in range(3)])
    proc = subprocess.Popen([sys.executable, "-m", "tapes.browse", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line
        body = httpx.get(m.group(0) + "api/tapes").json()
        assert body["total"] == 3
        assert "<title>tapeloop: tapes</title>" in httpx.get(m.group(0)).text
    finally:
        proc.terminate()
        proc.wait(10)
    out = subprocess.run([sys.executable, "-m", "tapes.browse", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert out.returncode == 2 and "run_dir" in out.stderr and "no tapes/ folder" in out.stderr


def test_show_prints_one_tape(tmp_path):
    path = tmp_path / "iter_000001.jsonl"
    write_tapes(path, [synthetic_tape(i, 1) for i in range(3)])
    out = subprocess.run([sys.executable, "-m", "tapes.show", str(path), "--index", "1", "--tokens"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "What is 1 + 1?" in text and "reward +0" in text
    assert text.index("1. task") < text.index("2. reasoning_thought") < text.index("3. final_answer_action")
    assert "logprob  -0.1000  ref  -0.2000" in text
    out = subprocess.run([sys.executable, "-m", "tapes.show", str(path), "--index", "7"], capture_output=True, text=True)
    assert out.returncode == 2 and "--index 7" in out.stderr and "holds 3 tapes" in out.stderr
