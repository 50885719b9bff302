"""The tape browser (`python -m orchestrate.after.browse`) driven in a real headless chromium, and the terminal view.

The page is checked for what a user sees: the run's config and curves, the tape list and its
filters, sorting and paging, one episode as a conversation (observations, actions with their
prompt and coloured output tokens, per-turn rewards and the learner's returns and advantages),
and its group. The returns and advantages shown are the learner's, read from RUN/advantages/:
a hand-made run with deliberately odd numbers (no recomputation could give them) checks that
the API, the page and orchestrate.after.show show exactly those. The `tiny_run` tests use the tapes of a real
2-iteration run on the tiny model; the 10,000-tape test makes its tapes.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from agents.agent import summarize
from contract.rundir import RunDir, read_advantages
from orchestrate.after.browse import RunIndex, serve
from orchestrate.after.episode_view import INFRA_FAILURE, learner_turns
from orchestrate.loop.samples import tape_samples
from tapes.store import read_tapes, write_tapes
from tapes.tape import (
    EnvAction,
    EnvObservation,
    LLMCall,
    SamplingParams,
    Tape,
    TapeMetadata,
    ToolCallAction,
    ToolResultObservation,
)

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

        # filters: reward, task, format error, truncation -- counts as in the files
        choose(page, "#f-reward", "<0")
        wait_rows(page, sum(t.metadata.reward < 0 for t in tapes[2]))
        choose(page, "#f-reward", ">0")
        wait_rows(page, sum(t.metadata.reward > 0 for t in tapes[2]))
        choose(page, "#f-reward", "")
        task = tapes[2][0].metadata.task_id
        type_in(page, "#f-task", task)
        wait_rows(page, sum(t.metadata.task_id == task for t in tapes[2]))
        assert {r.locator("td.task").get_attribute("data-task") for r in rows(page).all()} == {task}
        type_in(page, "#f-task", "")
        wait_rows(page, 8)
        for flag, select in (("format_error", "#f-format"), ("truncated", "#f-trunc"), ("success", "#f-success")):
            expected = {
                "format_error": sum(
                    any(isinstance(s, EnvObservation) and s.info.get("format_error") for s in t.steps) for t in tapes[2]
                ),
                "truncated": sum(
                    t.metadata.truncated or any(c.finish_reason == "length" for c in t.llm_calls) for t in tapes[2]
                ),
                "success": sum(bool(t.metadata.success) for t in tapes[2]),
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

        # one tape: a conversation (the observation, the action), the prompt, output tokens coloured by
        # log-prob, then by KL; the learner's return and advantage from its advantages file
        tape = tapes[1][5]
        page.locator("#rows tr[data-file='iter_000001.jsonl'][data-index='5']").click()
        page.locator("#tape-head").wait_for()
        head = page.locator("#tape-head").inner_text()
        assert tape.metadata.id in head and tape.metadata.reward_reason in head
        assert f"reward {tape.metadata.reward:.1f}" in head
        kinds = [k.text_content() for k in page.locator("#steps .kind").all()]
        assert kinds == [f"{i}. {s.kind}" for i, s in enumerate(tape.steps, start=1)]
        assert (
            page.locator("#conversation .bubble.user").first.locator(".observation").inner_text() == tape.steps[0].text
        )
        assert page.locator("#conversation .bubble.assistant").count() == tape.metadata.turns
        learned = learner_turns(read_advantages(tiny_run, 1), tape.metadata.id)
        shown = [float(b.get_attribute("data-value")) for b in page.locator(".t-advantage b").all()]
        assert shown == [t["advantage"] for t in learned]
        call = tape.llm_calls[0]
        prompt = page.locator("details.prompt[data-call='1']").text_content()
        assert tape.steps[0].text in prompt
        tokens = page.locator(".call[data-call='1'] .tokens .tok")
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
        first = page.locator(".call[data-call='1'] .tokens .tok").first
        assert f"KL {kl0:.4f}" in first.get_attribute("title")
        by_kl = [
            t.evaluate("e => e.style.backgroundColor") for t in page.locator(".call[data-call='1'] .tokens .tok").all()
        ]
        assert by_kl != by_logprob

        # the address links to the tape: opened anew, the page shows it again
        assert page.url.endswith("#tape=iter_000001.jsonl:5")
        page.reload()
        page.wait_for_function(
            f"document.querySelector('#tape-head')?.innerText.includes({json.dumps(tape.metadata.id)})"
        )

        # its group, side by side, with the advantages the learner trained with
        attempts = page.locator("#group-body .attempt")
        group = [t for t in tapes[1] if t.metadata.group_id == tape.metadata.group_id]
        assert attempts.count() == len(group) == 4
        page.wait_for_function(
            "![...document.querySelectorAll('#group-body .output')].some(e => e.textContent === '…')"
        )
        outputs = [a.locator(".output").inner_text() for a in attempts.all()]
        assert outputs == [t.llm_calls[0].output_text for t in group]
        advantages = read_advantages(tiny_run, 1)
        shown = [float(a.locator(".advantage").get_attribute("data-value")) for a in attempts.all()]
        assert shown == [learner_turns(advantages, t.metadata.id)[0]["advantage"] for t in group]
    finally:
        server.shutdown()


@vllm
def test_group_view_shows_the_learners_advantages(tiny_run, tmp_path, page):
    """The advantages shown are those of the learner's file (replaced here, on a copy of the run, by numbers no
    recomputation from the rewards gives), in the list and in the group view."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("checkpoints", "batches", "logs"))
    tapes = list(read_tapes(run / "tapes" / "iter_000001.jsonl"))
    learned = read_advantages(run, 1)
    assert set(learned) == {t.metadata.id for t in tapes}  # one sample per one-turn episode
    odd = {t.metadata.id: 0.5 - 0.137 * i for i, t in enumerate(tapes)}
    RunDir(run).write_advantages(1, [
        {"sample_id": sid, "turns": [{**turn, "advantage": odd[sid]} for turn in turns]} for sid, turns in learned.items()
    ])  # fmt: skip
    expected = [odd[t.metadata.id] for t in tapes]

    server, url = start_server(run)
    try:
        open_page(page, url)
        act(page, lambda: page.locator("a.file-link", has_text="iter_000001.jsonl").click())
        wait_rows(page, 8)
        assert [float(x) for x in column(page, "advantage")] == pytest.approx(expected, abs=0.006)
        assert [float(c.get_attribute("data-value")) for c in page.locator("#rows td.advantage").all()] == expected
        choose(page, "#f-sort", "-advantage")
        assert [float(x) for x in column(page, "advantage")] == pytest.approx(sorted(expected, reverse=True), abs=0.006)
        choose(page, "#f-sort", "")
        wait_rows(page, 8)
        rows(page).nth(1).click()
        page.locator("#tape-head").wait_for()
        shown = [float(a.get_attribute("data-value")) for a in page.locator("#group-body .attempt .advantage").all()]
        assert shown == expected[:4]
        assert page.locator("#group-body .attempt.current").inner_text().startswith("#1")
        page.locator("#group-body .attempt").nth(0).click()  # open another attempt from the group
        page.wait_for_function("document.querySelector('#tape-head').innerText.includes('#0')")
        assert f"reward {tapes[0].metadata.reward:.1f}" in page.locator("#tape-head").inner_text()
        assert float(page.locator(".t-advantage b").first.get_attribute("data-value")) == expected[0]
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
    tape.append(EnvObservation(text=f"What is {i} + 1?"))
    tape.append(EnvAction(text=call.output_text), llm_call=call)
    failed = {"format_error": True, "reason": "no \\boxed{} answer"} if i % 5 == 0 else {}
    tape.append(EnvObservation(text="no answer" if failed else f"answer {i + 1}", turn=1, reward=tape.metadata.reward,
                               terminated=True, info=failed))  # fmt: skip
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
        # (how fast each of these answers is measured by bench/bench_browse.py, not asserted here)
        open_page(page, url)
        wait_rows(page, 50)
        assert page.locator("#page-info").inner_text() == "1–50 of 10000"
        for action in (
            lambda: page.click("#next"),
            lambda: page.select_option("#f-format", "yes"),
            lambda: page.select_option("#f-sort", "-length"),
        ):
            act(page, action)
        assert page.locator("#page-info").inner_text() == "1–50 of 2000"  # every 5th tape is a parse failure
        lengths = [int(x) for x in column(page, "length")]
        assert lengths == sorted(lengths, reverse=True) and lengths[0] == max(5 + i % 40 for i in range(0, 2000, 5))

        # the last tape of the last file opens as fast as the first
        choose(page, "#f-format", "")
        choose(page, "#f-sort", "")
        choose(page, "#f-limit", "100")
        wait_rows(page, 100)
        for _ in range(3):  # a few pages on
            act(page, lambda: page.click("#next"))
        assert page.locator("#page-info").inner_text() == "301–400 of 10000"
        rows(page).last.click()
        page.wait_for_function(
            "document.querySelector('#tape-head') && document.querySelector('#tape-head').innerText.includes('#399')"
        )
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
    proc = subprocess.Popen([sys.executable, "-m", "orchestrate.after.browse", str(run), "--port", "0"],
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
    out = subprocess.run(
        [sys.executable, "-m", "orchestrate.after.browse", str(tmp_path / "nothing")], capture_output=True, text=True
    )
    assert out.returncode == 2 and "run_dir" in out.stderr and "no tapes/ folder" in out.stderr


def test_show_prints_one_tape(tmp_path):
    path = tmp_path / "iter_000001.jsonl"
    write_tapes(path, [synthetic_tape(i, 1) for i in range(3)])
    out = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(path), "--index", "1", "--tokens", "--steps"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "What is 1 + 1?" in text and "reward +0" in text
    assert text.index("[environment] reset") < text.index("[agent] turn 1") < text.index("answer 2")
    assert "turn 1: reward +0" in text and "learner" not in text  # not in a run directory: nothing said
    assert text.index("1. env_observation") < text.index("2. env_action") < text.index("3. env_observation")
    assert "logprob  -0.1000  ref  -0.2000" in text
    out = subprocess.run(
        [sys.executable, "-m", "orchestrate.after.show", str(path), "--index", "0"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "no \\boxed{} answer" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "orchestrate.after.show", str(path), "--index", "7"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "--index 7" in out.stderr and "holds 3 tapes" in out.stderr


# -- a hand-made run: multi-turn episodes and the learner's advantages file ---------------------------------------

ENV = "game:guess_the_number"
SECRET = "Guess my number <b>1..10</b> & win"  # markup in an observation is text, never HTML


def episode(
    seed: int,
    actions: list[tuple[str, str, float]],
    *,
    iteration: int = 1,
    rerender_at: int | None = None,
    last: dict | None = None,
    error: str | None = None,
) -> Tape:
    """An episode played by hand: each action is (the model's output, the environment's answer, reward); the last
    answer ends it (`last`: its end flags and info). The call of turn `rerender_at` does not extend the previous
    prompt (a re-rendered conversation)."""
    tape = Tape(metadata=TapeMetadata(task_id=f"{ENV}/train/{seed}", group_id=f"{iteration}:train:{seed // 10}",
                                      iteration=iteration, error=error),
                context={"env": {"id": ENV, "options": {}, "split": "train", "run_seed": 0, "seed": seed}})  # fmt: skip
    tape.append(EnvObservation(text=SECRET, turn=0))
    prompt = [1, 2, 3, 4]
    for turn, (output, answer, reward) in enumerate(actions, start=1):
        ids = [100 + turn, 200 + turn, 2]
        call = LLMCall(
            model="hand", messages=[{"role": "system", "content": "Play well."}, {"role": "user", "content": SECRET}],
            prompt_token_ids=prompt, output_text=output, output_token_ids=ids, logprobs=[-0.25 * turn, -1.5, -0.01],
            ref_logprobs=[-0.5, -1.0, -0.02], finish_reason="stop", turn=turn,
            extends_previous=None if turn == 1 else turn != rerender_at,
        )  # fmt: skip
        tape.append(EnvAction(text=output, turn=turn), llm_call=call)
        end = turn == len(actions)
        info = {"format_error": output == "???"} | ((last or {}).get("info", {}) if end else {})
        tape.append(EnvObservation(text=answer, turn=turn, reward=reward, info=info,
                                   terminated=end and (last or {}).get("terminated", False),
                                   truncated=end and (last or {}).get("truncated", False)))  # fmt: skip
        prompt = prompt + ids + [9, 9] if turn + 1 != rerender_at else [1, 5, 6, 7, 8, 9]
    return summarize(tape)


def handmade_run(root: Path) -> dict:
    """RUN/ with iteration 1 trained (two multi-turn episodes and an infrastructure failure, and the learner's
    advantages file with numbers no recomputation from the rewards gives), iteration 2 not trained yet, and an
    evaluation. Returns the tapes and the advantages written, by episode."""
    solved = episode(
        11,
        [("5", "higher", 0.0), ("8", "lower", 0.0), ("7", "correct!", 1.0)],
        last={"terminated": True, "info": {"success": True, "reason": "guessed 7 in 3 turns"}},
    )
    lost = episode(
        12,
        [("???", "say a number", -0.25), ("3", "higher", 0.0)],
        rerender_at=2,
        last={"truncated": True, "info": {"success": False, "reason": "turn limit (2) reached"}},
    )
    crashed = episode(21, [("4", "", 0.0)], error="RuntimeError: env crashed")
    later = episode(31, [("6", "correct!", 1.0)], iteration=2, last={"terminated": True, "info": {"success": True}})
    held_out = episode(41, [("2", "correct!", 1.0)], iteration=2, last={"terminated": True, "info": {"success": True}})
    write_tapes(root / "tapes" / "iter_000001.jsonl", [solved, lost, crashed])
    write_tapes(root / "tapes" / "iter_000002.jsonl", [later])
    write_tapes(root / "tapes" / "eval_000002.jsonl", [held_out])
    # what the learner would write, per sample: its ids and turn indexes as orchestrate.loop.samples makes them
    odd = {
        solved.metadata.id: [(0.91, 0.123456), (0.95, -0.5), (1.0, 2.75)],
        lost.metadata.id: [(-0.125, -0.987), (0.0, 0.31415)],
    }  # (return, advantage) per turn
    learned, expected = [], {}
    for tape in (solved, lost):
        for sample in tape_samples(tape, require_ref=True):
            turns = [{"index": t["index"], "reward": t["reward"], "return": odd[tape.metadata.id][t["index"]][0],
                      "advantage": odd[tape.metadata.id][t["index"]][1]} for t in sample["turns"]]  # fmt: skip
            learned.append({"sample_id": sample["sample_id"], "turns": turns})
            expected.setdefault(tape.metadata.id, []).extend(turns)
    assert [c["sample_id"] for c in learned][1:] == [f"{lost.metadata.id}:0", f"{lost.metadata.id}:1"]  # cut in two
    assert tape_samples(crashed, require_ref=True) == []
    RunDir(root).write_advantages(1, learned)
    (root / "metrics.jsonl").write_text(
        "".join(
            json.dumps(m) + "\n"
            for m in (
                {"iteration": 1, "reward_mean": 0.25, "success_rate": 0.5, "turns_mean": 2.5},
                {"iteration": 2, "reward_mean": 1.0, "success_rate": 1.0, "turns_mean": 1.0, "eval_success_rate": 1.0},
            )
        )
    )
    (root / "config.json").write_text(json.dumps({"env": {"id": ENV}, "train": {"estimator": "none"}}))
    return {
        "solved": solved,
        "lost": lost,
        "crashed": crashed,
        "later": later,
        "held_out": held_out,
        "advantages": expected,
    }


def test_api_shows_the_learners_advantages_per_turn(tmp_path):
    run = tmp_path / "run"
    made = handmade_run(run)
    solved, lost, expected = made["solved"], made["lost"], made["advantages"]
    index = RunIndex(run)

    listed = index.list({"kind": "all"})["items"]
    assert [(s["file"], s["index"]) for s in listed] == [("iter_000001.jsonl", 0), ("iter_000001.jsonl", 1),
                                                         ("iter_000001.jsonl", 2), ("iter_000002.jsonl", 0),
                                                         ("eval_000002.jsonl", 0)]  # fmt: skip
    first = {s["id"]: s for s in listed}
    s = first[solved.metadata.id]
    assert (s["env_id"], s["turns"], s["success"], s["end"], s["format_error"]) == (ENV, 3, True, "terminated", False)
    assert (s["trained"], s["learner_note"], s["return"], s["advantage"]) == (True, "trained", 0.91, 0.123456)
    assert s["question"] == SECRET and s["reward"] == 1.0
    s = first[lost.metadata.id]
    assert (s["turns"], s["success"], s["end"], s["format_error"], s["truncated"]) == (
        2,
        False,
        "truncated",
        True,
        True,
    )
    assert (s["return"], s["advantage"]) == (-0.125, -0.987)  # its first turn's, from the sample "<id>:0"
    s = first[made["crashed"].metadata.id]
    assert (s["trained"], s["learner_note"], s["advantage"]) == (False, INFRA_FAILURE, None)
    s = first[made["later"].metadata.id]
    assert (
        not s["trained"]
        and s["learner_note"].startswith("not trained on")
        and "advantages/000002.jsonl" in s["learner_note"]
    )
    assert first[made["held_out"].metadata.id]["learner_note"] == "not trained on (evaluation)"

    # filters on the episode's flags
    for query, ids in (
        ({"format_error": "yes"}, [lost]),
        ({"success": "yes"}, [solved]),
        ({"truncated": "yes"}, [lost]),
        ({"trained": "no"}, [made["crashed"]]),
        ({"task": "guess_the"}, [solved, lost, made["crashed"]]),
    ):
        assert [s["id"] for s in index.list({"iteration": "1", **query})["items"]] == [t.metadata.id for t in ids]
    assert [s["id"] for s in index.list({"iteration": "1", "sort": "-advantage"})["items"]] == [
        solved.metadata.id,
        lost.metadata.id,
        made["crashed"].metadata.id,
    ]  # untrained last

    # one episode over HTTP, as the page gets it: every turn with the file's numbers, exactly
    server, url = start_server(run)
    try:
        for i, tape in enumerate((solved, lost)):
            body = httpx.get(url + "api/tape", params={"file": "iter_000001.jsonl", "index": i}).json()
            turns = body["episode"]["turns"]
            assert [t["turn"] for t in turns] == list(range(1, tape.metadata.turns + 1))
            assert [t["learner"] for t in turns] == [{k: e[k] for k in ("reward", "return", "advantage")}
                                                     for e in expected[tape.metadata.id]]  # fmt: skip
            assert body["learner"] == {"trained": True, "note": "trained", "turns": expected[tape.metadata.id]}
            assert [t["action"] for t in turns] == [s.text for s in tape.steps if isinstance(s, EnvAction)]
            assert [t["call"] for t in turns] == list(range(tape.metadata.turns))
            assert body["episode"]["first_observation"]["text"] == SECRET
        assert [t["reward"] for t in turns] == [-0.25, 0.0] and [t["format_error"] for t in turns] == [True, False]
        assert body["episode"]["end"] == {"terminated": False, "truncated": True, "reason": "turn limit (2) reached",
                                          "success": False}  # fmt: skip
        assert [c["extends_previous"] for c in body["calls"]] == [None, False]
        assert body["calls"][0]["tokens"][0]["kl"] == pytest.approx(math.exp(-0.25) + 0.25 - 1)
        group = httpx.get(url + "api/group", params={"file": "iter_000001.jsonl", "group": "1:train:1"}).json()
        assert [(g["turns"], g["return"], g["advantage"]) for g in group["items"]] == [
            (3, 0.91, 0.123456),
            (2, -0.125, -0.987),
        ]
        for file, index_, note in (("iter_000001.jsonl", 2, INFRA_FAILURE), ("eval_000002.jsonl", 0, "not trained on")):
            body = httpx.get(url + "api/tape", params={"file": file, "index": index_}).json()
            assert body["learner"]["trained"] is False and body["learner"]["note"].startswith(note)
            assert all(t["learner"] is None for t in body["episode"]["turns"])

        # the learner writes iteration 2's file later: the browser picks it up
        later = made["later"]
        RunDir(run).write_advantages(
            2,
            [
                {
                    "sample_id": later.metadata.id,
                    "turns": [{"index": 0, "reward": 1.0, "return": 1.0, "advantage": -3.5}],
                }
            ],
        )
        body = httpx.get(url + "api/tape", params={"file": "iter_000002.jsonl", "index": 0}).json()
        assert body["episode"]["turns"][0]["learner"]["advantage"] == -3.5 and body["summary"]["trained"]
    finally:
        server.shutdown()


def test_page_shows_an_episode_as_a_conversation(tmp_path, page):
    run = tmp_path / "run"
    made = handmade_run(run)
    solved, _lost, expected = made["solved"], made["lost"], made["advantages"]
    server, url = start_server(run)
    try:
        open_page(page, url)
        act(page, lambda: page.locator("a.file-link", has_text="iter_000001.jsonl").click())
        wait_rows(page, 3)
        assert column(page, "turns") == ["3", "2", "1"]
        assert column(page, "success") == ["yes", "no", "no"]
        assert column(page, "end") == ["terminated", "truncated, format error", "infra error"]
        assert column(page, "advantage") == ["0.12", "-0.99", "–"]
        assert page.locator("#rows tr[data-index='2'] td.advantage").get_attribute("title") == INFRA_FAILURE
        choose(page, "#f-format", "yes")
        wait_rows(page, 1)
        choose(page, "#f-format", "")

        # the solved episode: observations as user bubbles, actions as assistant bubbles, turn by turn
        rows(page).nth(0).click()
        page.locator("#conversation").wait_for()
        conversation = page.locator("#conversation > *")
        assert [e.get_attribute("class") for e in conversation.all()] == [
            "bubble user", "bubble assistant", "bubble user", "bubble assistant", "bubble user",
            "bubble assistant", "bubble user", "episode-end"]  # fmt: skip
        observations = [o.inner_text() for o in page.locator("#conversation .observation").all()]
        assert observations == [SECRET, "higher", "lower", "correct!"]  # the markup shown as text
        assert page.locator("#conversation .observation b").count() == 0
        assistant = page.locator("#conversation .bubble.assistant")
        assert [a.locator(".tok").count() for a in assistant.all()] == [3, 3, 3]
        assert assistant.nth(2).locator(".tok").first.get_attribute("title").startswith("token 103: log-prob -0.7500")
        # per turn: the environment's reward, the learner's return and advantage (the file's numbers)
        rewards = [float(b.get_attribute("data-value")) for b in page.locator(".t-reward b").all()]
        assert rewards == [0.0, 0.0, 1.0]
        returns = [float(b.get_attribute("data-value")) for b in page.locator(".t-return b").all()]
        advantages = [float(b.get_attribute("data-value")) for b in page.locator(".t-advantage b").all()]
        assert returns == [t["return"] for t in expected[solved.metadata.id]] == [0.91, 0.95, 1.0]
        assert advantages == [t["advantage"] for t in expected[solved.metadata.id]]
        assert [b.inner_text() for b in page.locator(".t-advantage b").all()] == ["0.123", "-0.500", "2.750"]
        end = page.locator("#episode-end").inner_text()
        assert "terminated" in end and "guessed 7 in 3 turns" in end and "success" in end
        head = page.locator("#tape-head").inner_text()
        assert ENV in head and "3 turns" in head and page.locator("#tape-success").inner_text() == "yes"
        # the first call's prompt, collapsed; no re-rendered prompt here
        prompts = page.locator("#conversation details.prompt")
        assert prompts.count() == 1 and not prompts.first.evaluate("e => e.open")
        assert not prompts.first.locator(".msg").first.is_visible()
        prompts.first.locator("summary").click()
        assert prompts.first.locator(".msg").nth(1).inner_text().endswith(SECRET)
        assert page.locator(".badge.re-rendered").count() == 0
        # the group: each episode's return and advantage (its first turn's) and its turns
        attempts = page.locator("#group-body .attempt")
        assert attempts.count() == 2
        assert [a.locator(".turns").inner_text() for a in attempts.all()] == ["3", "2"]
        assert [float(a.locator(".advantage").get_attribute("data-value")) for a in attempts.all()] == [
            0.123456,
            -0.987,
        ]
        assert [float(a.locator(".return").get_attribute("data-value")) for a in attempts.all()] == [0.91, -0.125]

        # the other attempt: a format error, a re-rendered prompt (warned), truncated at the turn limit
        attempts.nth(1).click()
        page.wait_for_function("document.querySelector('#tape-head').innerText.includes('#1')")
        assert page.locator(".bubble.assistant[data-turn='2'] .badge.re-rendered").count() == 1
        assert page.locator(".bubble.assistant[data-turn='1'] .badge.re-rendered").count() == 0
        assert page.locator("#conversation details.prompt").count() == 2  # the first call's, the re-rendered one's
        assert page.locator(".bubble.user[data-turn='1'] .badge.format-error").inner_text() == "format error"
        advantages = [float(b.get_attribute("data-value")) for b in page.locator(".t-advantage b").all()]
        assert advantages == [-0.987, 0.31415]
        assert "truncated: turn limit (2) reached" in page.locator("#episode-end").inner_text()

        # not trained on: an infrastructure failure, an iteration not trained yet, an evaluation
        page.locator("#rows tr[data-index='2']").click()
        page.wait_for_function("document.querySelector('#tape-head').innerText.includes('#2')")
        assert page.locator("#tape-learner").inner_text() == INFRA_FAILURE
        assert "RuntimeError: env crashed" in page.locator("#tape-head").inner_text()
        assert page.locator(".t-advantage").count() == 0
        assert page.locator(".t-untrained").inner_text() == INFRA_FAILURE
        for file in ("iter_000002.jsonl", "eval_000002.jsonl"):
            act(page, lambda file=file: page.locator("a.file-link", has_text=file).click())
            rows(page).first.click()
            page.wait_for_function(f"document.querySelector('#tape-head').innerText.includes({json.dumps(file)})")
            assert page.locator("#tape-learner").inner_text().startswith("not trained on")
            assert page.locator(".t-advantage").count() == 0 and page.locator(".t-reward").count() == 1
    finally:
        server.shutdown()


def tool_episode() -> Tape:
    """A python-tool episode by hand: a call that prints, a call that fails, then the boxed answer."""
    question = "What is 123 * 456?\nYou may run Python: write <python>code</python>."
    tape = Tape(metadata=TapeMetadata(task_id="math:arithmetic/train/5", group_id="1:train:5", iteration=1),
                context={"env": {"id": "math:arithmetic", "options": {}, "split": "train", "run_seed": 0, "seed": 5,
                                 "tools": ["python"], "sandbox": {}}})  # fmt: skip
    tape.append(EnvObservation(text=question, turn=0))
    turns = [
        (
            "<python>\nprint(123 * 456)\n</python>",
            "print(123 * 456)",
            "<output>\n56088\n</output>",
            {"tool": "python", "stdout": "56088\n", "stderr": "", "exit_code": 0, "tool_error": False},
        ),
        (
            "<python>\n1 / 0\n</python>",
            "1 / 0",
            "<output>\nZeroDivisionError: division by zero\n[exit code 1]\n</output>",
            {"tool": "python", "stdout": "", "stderr": "ZeroDivisionError", "exit_code": 1, "tool_error": True},
        ),
    ]
    prompt = [1, 2, 3]
    for turn, (output, code, result, info) in enumerate(turns, start=1):
        call = LLMCall(model="hand", prompt_token_ids=prompt, output_text=output, output_token_ids=[7, 8, 9],
                       logprobs=[-0.1, -0.2, -0.3], finish_reason="stop", turn=turn,
                       extends_previous=None if turn == 1 else True)  # fmt: skip
        tape.append(ToolCallAction(text=output, turn=turn, tool="python", call=code), llm_call=call)
        tape.append(ToolResultObservation(text=result, turn=turn, tool="python", reward=0.0, info=info))
        prompt = prompt + [7, 8, 9, 4]
    call = LLMCall(
        model="hand",
        prompt_token_ids=prompt,
        output_text="The answer is \\boxed{56088}.",
        output_token_ids=[5, 6],
        logprobs=[-0.1, -0.1],
        finish_reason="stop",
        turn=3,
        extends_previous=True,
    )
    tape.append(EnvAction(text="The answer is \\boxed{56088}.", turn=3), llm_call=call)
    tape.append(EnvObservation(text="", turn=3, reward=1.0, terminated=True, info={"success": True}))
    return summarize(tape)


def test_page_shows_a_tool_episode(tmp_path, page):
    """Tool calls and tool results are named as such: which tool, what it was given, its output as text (markup
    in it is not HTML), a failed run flagged."""
    run = tmp_path / "run"
    tape = tool_episode()
    write_tapes(run / "tapes" / "iter_000001.jsonl", [tape])
    (run / "config.json").write_text(json.dumps({"env": {"id": "math:arithmetic", "tools": ["python"]}}))
    server, url = start_server(run)
    try:
        open_page(page, url)
        act(page, lambda: page.locator("a.file-link", has_text="iter_000001.jsonl").click())
        wait_rows(page, 1)
        assert column(page, "turns") == ["3"] and column(page, "success") == ["yes"]
        rows(page).nth(0).click()
        page.locator("#conversation").wait_for()
        calls = page.locator("#conversation .bubble.assistant .badge.tool-call")
        assert [b.inner_text() for b in calls.all()] == ["python call", "python call"]  # not on the answer
        assert page.locator(".bubble.assistant[data-turn='3'] .badge.tool-call").count() == 0
        results = page.locator("#conversation .bubble.user.tool-result")
        assert results.count() == 2
        assert [
            r.locator(".who").inner_text().split("\n")[0].startswith(f"python tool · result of turn {i}")
            for i, r in enumerate(results.all(), start=1)
        ] == [True, True]
        assert results.nth(0).locator(".observation").inner_text() == "<output>\n56088\n</output>"
        assert results.nth(0).locator(".observation output").count() == 0  # shown as text, not parsed
        assert results.nth(0).locator(".badge.tool-error").count() == 0
        assert results.nth(1).locator(".badge.tool-error").inner_text() == "tool error"
        assert "ZeroDivisionError" in results.nth(1).locator(".observation").inner_text()
        # the environment's answer to the last turn is an ordinary environment bubble with the reward
        assert "environment · answer to turn 3" in page.locator(".bubble.user[data-turn='3'] .who").inner_text()
        assert "success" in page.locator("#episode-end").inner_text()
    finally:
        server.shutdown()


def test_show_prints_an_episode_with_the_learners_advantages(tmp_path):
    run = tmp_path / "run"
    handmade_run(run)

    def show(file, index):
        out = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(run / "tapes" / file), "--index", str(index)],
                             capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    text = show("iter_000001.jsonl", 0)
    assert f"env {ENV}" in text and "(3 turns, success yes, terminated)" in text and "learner: trained" in text
    order = ["[environment] reset", SECRET, "[agent] turn 1", "prompt of call 1", "[system] Play well.",
             "turn 1: reward +0  return +0.91  advantage +0.123456", "[environment] answer to turn 1", "higher",
             "[agent] turn 2", "turn 2: reward +0  return +0.95  advantage -0.5", "lower",
             "[agent] turn 3", "turn 3: reward +1  return +1  advantage +2.75", "correct!",
             "end: terminated (guessed 7 in 3 turns), success yes"]  # fmt: skip
    positions = [text.index(part) for part in order]
    assert positions == sorted(positions), text
    assert text.count("prompt of call") == 1 and "re-rendered" not in text

    text = show("iter_000001.jsonl", 1)
    assert "turn 1: reward -0.25  return -0.125  advantage -0.987" in text
    assert "turn 2: reward +0  return +0  advantage +0.31415" in text
    assert "WARNING: prompt re-rendered" in text and "format error" in text
    assert "end: truncated (turn limit (2) reached), success no" in text

    text = show("iter_000001.jsonl", 2)
    assert f"learner: {INFRA_FAILURE}" in text and "agent error: RuntimeError: env crashed" in text
    assert "return" not in text and not re.search(r"advantage [-+\d]", text)
    for file in ("iter_000002.jsonl", "eval_000002.jsonl"):
        text = show(file, 0)
        assert "learner: not trained on" in text and "turn 1: reward +1" in text
        assert "return" not in text and not re.search(r"advantage [-+\d]", text)


def test_a_ppo_learners_values_show_beside_its_advantages(tmp_path):
    """With PPO the advantages file also holds the critic's value before each turn: the API and orchestrate.after.show
    give it, as written."""
    run = tmp_path / "run"
    made = handmade_run(run)
    solved = made["solved"]
    path = run / "advantages" / "000001.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        for k, turn in enumerate(record["turns"]):
            turn["value"] = 0.375 + k
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    server, url = start_server(run)
    try:
        body = httpx.get(url + "api/tape", params={"file": "iter_000001.jsonl", "index": 0}).json()
    finally:
        server.shutdown()
    assert [t["learner"]["value"] for t in body["episode"]["turns"]] == [0.375, 1.375, 2.375]
    out = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(run / "tapes" / "iter_000001.jsonl"), "--index",
                          "0"], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "turn 1: reward +0  return +0.91  advantage +0.123456  value +0.375" in out.stdout
    assert solved.metadata.turns == 3


def strict_json(text: str):
    """JSON as a browser's JSON.parse reads it: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"the API sent the bare constant {c}"))


def test_non_finite_numbers_show_in_the_api_the_page_and_show(tmp_path, page):
    """A log-prob of -inf (legitimate vLLM output), a NaN reward and an infinite metric: the tape file keeps them,
    the API sends them as the strings "-Infinity"/"NaN" (JSON.parse refuses the bare constants), the page shows
    them without a script error, orchestrate.after.show prints them."""
    run = tmp_path / "run"
    tape = episode(11, [("5", "higher", float("nan")), ("7", "correct!", 1.0)], last={"terminated": True})
    tape.llm_calls[0].logprobs[1] = float("-inf")
    tape.llm_calls[0].ref_logprobs[0] = float("nan")
    tape.metadata.reward = float("nan")
    tape.steps[2].info["score"] = float("inf")
    write_tapes(run / "tapes" / "iter_000001.jsonl", [tape])
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "reward_mean": float("nan"), "kl_ref": 0.5}) + "\n")
    (run / "config.json").write_text("{}")
    server, url = start_server(run)
    try:
        summaries = strict_json(httpx.get(url + "api/tapes", params={"kind": "all"}).text)["items"]
        assert summaries[0]["reward"] == "NaN" and not summaries[0].get("bad_line")
        body = strict_json(httpx.get(url + "api/tape", params={"file": "iter_000001.jsonl", "index": 0}).text)
        tokens = body["calls"][0]["tokens"]
        assert [t["logprob"] for t in tokens] == [-0.25, "-Infinity", -0.01]
        assert tokens[0]["ref_logprob"] == "NaN" and tokens[0]["kl"] == "NaN"
        assert body["metadata"]["reward"] == "NaN" and body["episode"]["turns"][0]["reward"] == "NaN"
        assert body["steps"][2]["info"]["score"] == "Infinity"
        assert strict_json(httpx.get(url + "api/run").text)["metrics"][0]["reward_mean"] == "NaN"

        open_page(page, url)  # the fixture fails the test on any script error
        act(page, lambda: page.locator("a.file-link", has_text="iter_000001.jsonl").click())
        wait_rows(page, 1)
        assert column(page, "reward") == ["NaN"]
        rows(page).nth(0).click()
        page.locator("#conversation").wait_for()
        first = page.locator("#conversation .bubble.assistant").nth(0).locator(".tok")
        assert first.nth(1).get_attribute("title").startswith("token 201: log-prob -Infinity")
        assert "rgba(239, 108, 0, 1.000)" in first.nth(1).get_attribute("style")  # the darkest: least likely
        page.locator("input[name='colour'][value='kl']").check()
        assert "transparent" in first.nth(0).get_attribute("style")  # a NaN KL is not coloured
    finally:
        server.shutdown()
    out = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(run / "tapes" / "iter_000001.jsonl"),
                          "--tokens"], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "-inf" in out.stdout and "nan" in out.stdout


# -- trees ------------------------------------------------------------------------------------------------


def tree_tapes() -> list[Tape]:
    """A task's tree: roots #0 and #1, #2 forks #0 at call 1, #3 forks #2 at call 2, #4 a fork of #1 that
    did not come back to its branch point."""

    def tape(reward, parent=None, at=None, dropped=None):
        calls = [LLMCall(prompt_token_ids=[1, 2], output_token_ids=[3], logprobs=[-0.5], output_text=f"guess {k}")
                 for k in range(3)]  # fmt: skip
        t = Tape(metadata=TapeMetadata(group_id="1:train:0", task_id="game/train/0", reward=reward,
                                       success=reward > 0, parent_id=parent, branch_at=at, dropped=dropped,
                                       iteration=1, turns=3),
                 steps=[EnvObservation(text="Guess a number.", turn=0)], llm_calls=calls)  # fmt: skip
        if dropped:
            t.metadata.error = "fork at call 1: call #1 prompt differs from the recorded one"
        return t

    roots = [tape(0.0), tape(1.0)]
    first = tape(1.0, roots[0].metadata.id, 1)
    return [*roots, first, tape(0.0, first.metadata.id, 2), tape(0.0, roots[1].metadata.id, 1, "fork_diverged")]


def test_show_and_the_api_show_a_tasks_tree(tmp_path):
    run = tmp_path / "run"
    tapes = tree_tapes()
    write_tapes(run / "tapes" / "iter_000001.jsonl", tapes)
    out = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(run / "tapes" / "iter_000001.jsonl"),
                          "--index", "2", "--no-color"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    tree = out[out.index("[tree]") :].splitlines()
    assert tree == [
        "[tree] 2 roots, 3 forks (this tape marked >)",
        "  #0 reward +0, 3 calls",
        ">     #2 fork at call 1, reward +1, success, 3 calls",
        "          #3 fork at call 2, reward +0, 3 calls",
        "  #1 reward +1, success, 3 calls",
        "      #4 fork at call 1, reward +0, 3 calls (did not come back to its branch point: not trained)",
    ]
    assert f"fork of tape {tapes[0].metadata.id}: its first 1 LLM calls replayed" in out
    group = RunIndex(run).tape("iter_000001.jsonl", 3)["group"]
    assert [(g["index"], g["depth"]) for g in group] == [(0, 0), (2, 1), (3, 2), (1, 0), (4, 1)]
    # a group without forks keeps its order and prints no tree
    write_tapes(run / "tapes" / "iter_000002.jsonl", tapes[:2])
    plain = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(run / "tapes" / "iter_000002.jsonl"),
                            "--no-color"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "[tree]" not in plain


def test_page_shows_a_tasks_tree(tmp_path, page):
    run = tmp_path / "run"
    write_tapes(run / "tapes" / "iter_000001.jsonl", tree_tapes())
    (run / "config.json").write_text(json.dumps({"env": {"id": "game:guess_the_number"}}))
    server, url = start_server(run)
    try:
        page.goto(url + "#tape=iter_000001.jsonl:3")
        page.locator("#group-body .attempt").first.wait_for()
        assert "a tree: 2 roots and 3 forks" in page.locator("#group-body").inner_text()
        attempts = page.locator("#group-body .attempt")
        assert [a.get_attribute("data-index") for a in attempts.all()] == ["0", "2", "3", "1", "4"]
        assert "fork of #2 at call 2" in attempts.nth(2).inner_text()
        assert "did not come back" in attempts.nth(4).inner_text()
        margins = [a.evaluate("e => getComputedStyle(e).marginLeft") for a in attempts.all()]
        assert margins[0] == "0px" and float(margins[2][:-2]) > float(margins[1][:-2]) > 0
    finally:
        server.shutdown()
