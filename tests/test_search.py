"""The search tool and the qa environment: BM25 retrieval over a corpus the test writes (invented facts, so
no model or data set knows them), the index cached beside the corpus, HotpotQA's answer scores worked by
hand, scripted episodes through the tool wrapper and the real agent, replay from the recorded results,
and the command line's refusals."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.envs.registry import make_env
from agents.rewards import normalize_answer, qa_scores, token_f1
from agents.search import CorpusError, Retriever, SearchConfig, load_retriever
from agents.tools import SearchTool, ToolEnv
from tests.scripted import scripted_call

ROOT = Path(__file__).resolve().parent.parent

# (title, text): the first ten hold the answers the questions below ask for; the rest are distractors that
# share words with them (countries, rivers, inventors, years).
FACTS = [
    ("Zorbia", "Zorbia is a small inland country. The capital of Zorbia is Quelport, a city on the Vell river."),
    ("Marta Ilvane", "Marta Ilvane invented the spiral loom in 1832 while working in a mill in Dorrow."),
    ("Vell river", "The Vell river rises in the Kassan hills and is 412 kilometres long."),
    ("Tobrin Ash", "Tobrin Ash wrote the novel The Glass Orchard, published in 1907."),
    ("Quelport", "Quelport is famous for its copper domes and a yearly lantern festival in autumn."),
    ("Peskin cheese", "Peskin cheese is made from the milk of mountain goats and aged in salt caves."),
    ("Harrow Bell", "The Harrow Bell weighs nine tonnes and hangs in the tower of Lisk cathedral."),
    ("Orvane", "The Orvane is a migratory bird that winters on the island of Semmet."),
    ("Dalla Fenn", "Dalla Fenn was the first person to sail alone around the Ostric sea, in 1764."),
    ("Kassan hills", "The highest point of the Kassan hills is Mount Brevel."),
    ("Estmark", "Estmark is a coastal country; its capital is Varn, a harbour city."),
    ("Lowen river", "The Lowen river flows through Varn and is 95 kilometres long."),
    ("Ilvane family", "The Ilvane family ran textile mills for three generations."),
    ("Dorrow", "Dorrow is a market town known for wool and for its old stone bridge."),
    ("The Silver Orchard", "The Silver Orchard is a painting of apple trees at dusk."),
    ("Glass making", "Glass making in the region began in the twelfth century."),
    ("Copper mining", "Copper was mined in the hills east of the capital until 1950."),
    ("Lantern making", "Paper lanterns are folded from mulberry paper and lit with candles."),
    ("Goats", "Mountain goats climb steep rock faces and eat lichen in winter."),
    ("Salt caves", "The salt caves near the coast are visited by many tourists each summer."),
    ("Lisk", "Lisk is a cathedral city with a famous choir school."),
    ("Bell founding", "Large bells are cast in sand moulds from bronze."),
    ("Semmet", "Semmet is a rocky island with lighthouses and seal colonies."),
    ("Migration", "Many birds fly south for the winter and return in spring."),
    ("Ostric sea", "The Ostric sea is shallow and freezes along its northern shore."),
    ("Sailing", "Sailing alone across an ocean takes months of preparation."),
    ("Brevel", "Brevel is also a common family name in the northern valleys."),
    ("Mountains", "The highest mountains of the continent lie far to the west."),
    ("Spiral staircases", "A spiral staircase saves space in narrow towers."),
    ("Novels", "The first novels in the northern language appeared in the eighteenth century."),
]
QUESTIONS = [  # (question, answer, index of the passage that holds it)
    ("What is the capital of Zorbia?", "Quelport", 0),
    ("Who invented the spiral loom?", "Marta Ilvane", 1),
    ("How long is the Vell river?", "412 kilometres", 2),
    ("Who wrote The Glass Orchard?", "Tobrin Ash", 3),
    ("Which city is famous for copper domes and a lantern festival?", "Quelport", 4),
    ("Peskin cheese is made from the milk of which animal?", "mountain goats", 5),
    ("How much does the Harrow Bell weigh?", "nine tonnes", 6),
    ("Where does the Orvane bird spend the winter?", "Semmet", 7),
    ("Who first sailed alone around the Ostric sea?", "Dalla Fenn", 8),
    ("What is the highest point of the Kassan hills?", "Mount Brevel", 9),
]


def write_corpus(path: Path, facts=FACTS) -> Path:
    rows = [{"id": f"p{i}", "title": title, "text": text} for i, (title, text) in enumerate(facts)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_questions(path: Path) -> Path:
    rows = [{"id": f"q{i}", "question": q, "answer": a} for i, (q, a, _) in enumerate(QUESTIONS)]
    rows[0]["answer"] = ["Quelport", "Quelport city"]
    # enough questions that both splits have some at test_fraction 0.5
    rows += [{"question": f"What is {n} plus {n}?", "answer": str(2 * n)} for n in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "passages.jsonl")


# -- retrieval and its cache ----------------------------------------------------------------------------


def test_retrieval_puts_the_passage_holding_the_answer_first(corpus):
    retriever = Retriever.from_corpus(corpus)
    for question, answer, where in QUESTIONS:
        hits = retriever.search(question, 3)
        assert hits[0][0].id == f"p{where}", (question, [(p.title, s) for p, s in hits])
        assert answer.split()[0] in hits[0][0].text
        assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True) and hits[0][1] > 0
    assert retriever.search("the of a and", 3) == []  # only stopwords: nothing to look up
    assert retriever.search("xylophone quasar", 3) == []  # no passage shares a word


def test_the_index_is_cached_beside_the_corpus_reused_and_rebuilt_when_the_corpus_changes(corpus, tmp_path):
    cache = tmp_path / "passages.jsonl.bm25s"
    first = Retriever.from_corpus(corpus)
    assert first.built and (cache / "manifest.json").is_file()
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["passages"] == len(FACTS) and manifest["corpus_bytes"] == corpus.stat().st_size
    stamp = (cache / "manifest.json").stat().st_mtime_ns
    again = Retriever.from_corpus(corpus)
    assert not again.built and (cache / "manifest.json").stat().st_mtime_ns == stamp  # read, not rebuilt
    assert again.search("capital of Zorbia", 1)[0][0].id == "p0"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left

    write_corpus(corpus, FACTS + [("Zorbia anthem", "The anthem of Zorbia is called Morning over Quelport.")])
    changed = Retriever.from_corpus(corpus)
    assert changed.built and json.loads((cache / "manifest.json").read_text())["passages"] == len(FACTS) + 1
    assert changed.search("anthem of Zorbia", 1)[0][0].id == f"p{len(FACTS)}"
    assert not Retriever.from_corpus(corpus).built


def test_an_unwritable_cache_folder_builds_in_memory_with_a_warning(corpus, tmp_path, caplog, monkeypatch):
    import agents.search

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(agents.search.tempfile, "mkdtemp", refuse)  # a read-only folder (root may write anywhere)
    retriever = Retriever.from_corpus(corpus)
    assert retriever.built and retriever.search("Harrow Bell", 1)[0][0].id == "p6"
    assert not (tmp_path / "passages.jsonl.bm25s").exists()
    assert "cannot keep the BM25 index" in caplog.text and "cache_dir" in caplog.text
    monkeypatch.undo()
    elsewhere = tmp_path / "cache" / "index"
    assert Retriever.from_corpus(corpus, cache_dir=elsewhere).built and (elsewhere / "manifest.json").is_file()
    assert not Retriever.from_corpus(corpus, cache_dir=elsewhere).built


def test_a_corpus_that_cannot_be_used_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    for content, words in [("", "holds no passages"), ('{"text": "ok"}\n{"title": "no text"}\n', "line 2"),
                           ('{"text": "ok"}\nnot json\n', "line 2: not JSON")]:  # fmt: skip
        bad.write_text(content)
        with pytest.raises(CorpusError, match=words):
            Retriever.from_corpus(bad)
    with pytest.raises(CorpusError, match="No such file"):
        load_retriever(tmp_path / "missing.jsonl")


# -- answer scores --------------------------------------------------------------------------------------


def test_normalised_exact_match_and_f1_worked_by_hand():
    assert normalize_answer("The Eiffel  Tower!") == "eiffel tower"
    assert qa_scores("The Eiffel Tower!", ["eiffel tower"]) == (1.0, 1.0)
    # "big red dog" (the article goes) against "red dog barks": 2 words in common, precision 2/3, recall 2/3
    assert token_f1("the big red dog", "red dog barks") == pytest.approx(2 / 3)
    assert qa_scores("the big red dog", ["red dog barks"]) == (0.0, pytest.approx(2 / 3))
    # "red dog" against "the red dog barks loudly": precision 2/2, recall 2/4 -> 2 * 1 * 0.5 / 1.5 = 2/3
    assert token_f1("red dog", "the red dog barks loudly") == pytest.approx(2 / 3)
    # several accepted answers: the best of each score
    em, f1 = qa_scores("New York", ["NYC", "New York City", "new york"])
    assert em == 1.0 and f1 == 1.0
    em, f1 = qa_scores("New York", ["NYC", "New York City"])
    assert em == 0.0 and f1 == pytest.approx(0.8)  # 2 of 2 predicted, 2 of 3 wanted: 2 * 1 * 2/3 / (5/3)
    assert qa_scores("Paris", ["London"]) == (0.0, 0.0)


# -- the qa environment and the tool --------------------------------------------------------------------


@pytest.fixture
def qa(tmp_path):
    questions = write_questions(tmp_path / "questions.jsonl")
    return {"questions": str(questions), "test_fraction": 0.5}


def episode_of(qa: dict, question: str, **options):
    """(environment of the split that holds `question`, the episode seed that poses it)."""
    for split in ("train", "test"):
        env = make_env("qa", {**qa, **options}, split=split)
        for seed in range(200):
            if env.reset(seed=seed)[0].startswith(question):
                return env, seed
    raise AssertionError(f"{question!r} is in neither split")


def test_splits_are_disjoint_deterministic_and_cover_every_question(qa):
    train, test = make_env("qa", qa, split="train"), make_env("qa", qa, split="test")
    train_q, test_q = {q.question for q in train.questions}, {q.question for q in test.questions}
    assert train_q and test_q and not train_q & test_q and len(train_q) + len(test_q) == len(QUESTIONS) + 40
    assert test.test_size == len(test_q)
    assert [test.reset(seed=k)[0] for k in range(test.test_size)] == [
        f"{q.question}\nGive the answer as a short phrase in \\boxed{{}}." for q in test.questions
    ]
    first_pass = {train.reset(seed=k)[1]["task_id"] for k in range(len(train_q))}
    assert len(first_pass) == len(train_q)  # one pass over every train question, each once
    again = make_env("qa", qa, split="train")
    assert [again.reset(seed=k)[0] for k in range(10)] == [train.reset(seed=k)[0] for k in range(10)]
    other_run = make_env("qa", qa, split="train", run_seed=1)
    assert [other_run.reset(seed=k)[0] for k in range(10)] != [train.reset(seed=k)[0] for k in range(10)]


def test_answers_are_scored_by_exact_match_or_f1(qa):
    env, seed = episode_of(qa, "Who invented the spiral loom?")  # -> "Marta Ilvane"
    env.reset(seed=seed)
    _, reward, terminated, _, info = env.step("It was \\boxed{marta ilvane.}")
    assert reward == 1.0 and terminated and info["success"] and info["em"] == 1.0 and not info["format_error"]
    _, reward, _, _, info = env.step("\\boxed{Marta}")
    assert reward == 0.0 and not info["success"] and info["f1"] == pytest.approx(2 / 3)
    _, reward, _, _, info = env.step("Marta Ilvane")
    assert reward == -0.1 and info["format_error"] and not info["success"]
    env, seed = episode_of(qa, "What is the capital of Zorbia?", reward="f1")  # accepted: Quelport, Quelport city
    env.reset(seed=seed)
    assert env.step("\\boxed{Marta}")[1] == 0.0
    _, reward, _, _, info = env.step("\\boxed{the city of Quelport}")
    assert reward == pytest.approx(0.8) and info["em"] == 0.0 and not info["success"]  # best F1: "quelport city"


def search_tool(corpus, **config):
    return SearchTool(load_retriever(corpus), SearchConfig(corpus=str(corpus), **config))


def test_the_search_tool_answers_in_search_r1_format(corpus):
    tool = search_tool(corpus, top_k=2)
    call = tool.parse("I should look it up.\n<search> capital of Zorbia </search>")
    assert call.tool == "search" and call.text == "capital of Zorbia"
    assert tool.parse("<search>unclosed") is None and tool.parse("\\boxed{x}") is None
    observation, info = tool.execute(call)
    assert observation.startswith("<information>Doc 1 (Title: Zorbia) Zorbia is a small inland country.")
    assert "\nDoc 2 (Title: " in observation and observation.endswith("</information>")
    assert info["query"] == "capital of Zorbia" and info["ids"][0] == "p0" and len(info["scores"]) == 2
    assert info["tool_error"] is False and info["output_truncated"] is False
    observation, info = tool.execute(tool.parse("<search>  </search>"))
    assert info["tool_error"] is True and "empty query" in observation
    observation, info = search_tool(corpus, top_k=5, observation_chars=200).execute(
        tool.parse("<search>Zorbia Quelport Vell</search>")
    )
    assert info["output_truncated"] and len(observation) <= 200 + len("<information> [... cut]</information>")


def test_a_scripted_episode_searches_then_answers(qa, corpus):
    question, answer, _ = QUESTIONS[3]
    inner, seed = episode_of(qa, question)
    env = ToolEnv(inner, [search_tool(corpus)])
    observation, _ = env.reset(seed=seed)
    assert (
        observation.startswith(question)
        and "<search>query</search>" in observation
        and env.stop == ["</search>", "</tool_call>"]
    )
    obs, reward, terminated, _, info = env.step(f"<search>{question}</search>")
    assert reward == 0.0 and not terminated and info["tool"] == "search" and info["tool_calls"] == 1
    assert answer in obs.split("Doc 2")[0]  # the best passage holds the answer
    obs, reward, terminated, _, info = env.step(f"From the passages: \\boxed{{{answer}}}")
    assert reward == 1.0 and terminated and info["success"] and info["tool_calls"] == 1


class ScriptedLLM:
    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.stops = tokenizer, list(texts), []

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):

        self.stops.append(list(sampling.stop))
        text = self.texts.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text)


def test_an_agent_episode_is_recorded_as_search_steps_and_replays_from_the_recorded_results(
    qa, corpus, tokenizer, tmp_path
):
    """The real ChatAgent: sampling stops at `</search>`, the search is a ToolCallAction / ToolResultObservation
    on the tape, and the replay answers it from the tape (the corpus is gone by then) and says so."""
    from agents.agent import AgentConfig, ChatAgent
    from agents.chat import ChatTokens
    from agents.env_spec import EnvSpec
    from orchestrate.after.episode_view import episode_view
    from orchestrate.after.replay import replay_tape
    from tapes.store import read_tapes, write_tapes
    from tapes.tape import SamplingParams, Tape, ToolCallAction, ToolResultObservation

    question, answer, _ = QUESTIONS[8]
    inner, seed = episode_of(qa, question)
    spec = EnvSpec(
        "qa", qa, "test" if inner.test_size else "train", 0, ["search"], search={"corpus": str(corpus), "top_k": 2}
    )
    llm = ScriptedLLM(
        tokenizer,
        [f"Let me look.\n<search>{question}</search>", "<search>Ostric sea</search>", f"So \\boxed{{{answer}}}"],
    )
    agent = ChatAgent(AgentConfig(max_turns=4), SamplingParams(max_tokens=64), ChatTokens(tokenizer))
    tape = asyncio.run(agent.run_episode(spec.make(), seed, llm, Tape(context=spec.context(seed))))
    assert llm.stops == [["</search>", "</tool_call>"]] * 3
    assert [s.kind for s in tape.steps] == [
        "env_observation",
        "tool_call",
        "tool_result",
        "tool_call",
        "tool_result",
        "env_action",
        "env_observation",
    ]
    call, result = tape.steps[1], tape.steps[2]
    assert isinstance(call, ToolCallAction) and call.tool == "search" and call.call == question
    assert isinstance(result, ToolResultObservation) and result.tool == "search" and answer in result.text
    assert result.info["query"] == question and len(result.info["ids"]) == 2 and result.reward == 0.0
    assert tape.metadata.success and tape.metadata.reward == 1.0 and tape.llm_calls[2].extends_previous
    assert tape.context["env"]["search"] == {"corpus": str(corpus), "top_k": 2} and "sandbox" not in tape.context["env"]

    path = write_tapes(tmp_path / "iter_000001.jsonl", [tape])
    (saved,) = read_tapes(path)
    turns = episode_view(saved, None)["turns"]
    assert [(t["tool"], t["tool_call"]) for t in turns] == [("search", question), ("search", "Ostric sea"),
                                                            (None, None)]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "orchestrate.after.show", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "[agent] turn 1 (search call)" in out.stdout and "[search tool] result of turn 1" in out.stdout
    assert "Doc 1 (Title: " in out.stdout

    os.remove(corpus)  # the replay must not need the corpus: it answers from the tape
    replayed, diff = asyncio.run(replay_tape(saved, agent))
    assert diff.identical, diff.report()
    assert diff.how == ["answered 2 search calls from the recorded results"]
    assert "identical (answered 2 search calls from the recorded results)" in diff.report()
    assert replayed.steps[2].text == result.text and replayed.metadata.reward == 1.0

    edited = saved.model_copy(deep=True)  # an output that now asks another query: the replay says where
    edited.llm_calls[1].output_text = "<search>Harrow Bell</search>"
    _, diff = asyncio.run(replay_tape(edited, agent))
    assert not diff.identical and "asks 'Harrow Bell'; the tape recorded 'Ostric sea'" in diff.report()


# -- configuration and preflight ------------------------------------------------------------------------


def test_search_from_the_command_line_is_recorded_for_replay(qa, corpus):
    from agents.env_spec import EnvSpec
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.config_checks import ConfigError
    from tapes.tape import Tape

    config = resolve("embedded", {"env.id": "qa", "env.options.questions": qa["questions"], "env.tools": "search",
                                  "env.search.corpus": str(corpus), "env.search.top_k": "2"})  # fmt: skip
    spec = EnvSpec.from_config(config, "train")
    env = spec.make()
    assert isinstance(env, ToolEnv) and env.tools[0].name == "search" and env.tools[0].config.top_k == 2
    assert spec.make().tools[0].retriever is env.tools[0].retriever  # loaded once
    context = spec.context(3)["env"]
    assert context["tools"] == ["search"] and context["search"] == {"corpus": str(corpus), "top_k": 2}
    again, _ = EnvSpec.of(Tape(context={"env": context}))
    assert again.search_options == {"corpus": str(corpus), "top_k": 2}

    with pytest.raises(ConfigError, match=r"^--env\.search\.corpus: --env\.tools search needs a corpus"):
        resolve("embedded", {"env.id": "qa", "env.options.questions": qa["questions"], "env.tools": "search"})
    with pytest.raises(ConfigError, match=r"^--env\.search\.top_k: "):
        resolve("embedded", {"env.tools": "search", "env.search.corpus": str(corpus), "env.search.top_k": "0"})
    with pytest.raises(ConfigError, match=r"^--env\.options\.questions: file .*nope\.jsonl does not exist"):
        resolve("embedded", {"env.id": "qa", "env.options.questions": str(Path(qa["questions"]).parent / "nope.jsonl")})
    with pytest.raises(ConfigError, match=r"^--env\.options\.reward: "):
        resolve("embedded", {"env.id": "qa", "env.options.questions": qa["questions"], "env.options.reward": "bleu"})


def test_preflight_refuses_a_bad_corpus_or_questions_file_naming_the_option(qa, tmp_path, rl_cli):
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.preflight import PreflightError, check_environment, check_qa_questions

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    # the command line: one line naming the option, before the run directory is made
    run_dir = tmp_path / "run"
    code, line = rl_cli(["--env.id", "qa", "--env.options.questions", qa["questions"], "--env.tools", "search",
                         "--env.search.corpus", empty, "--run-dir", run_dir])  # fmt: skip
    assert code == 2 and line == f"error: --env.search.corpus: {empty} holds no passages", line
    assert not run_dir.exists()
    with pytest.raises(PreflightError, match=r"^--env\.options\.questions: .*empty\.jsonl holds no questions$"):
        check_qa_questions(str(empty), "--env.options.questions")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Q?", "answer": 3}\n')
    with pytest.raises(PreflightError, match=r"^--env\.options\.questions: .*line 1: 'answer' must be a string"):
        check_qa_questions(str(bad), "--env.options.questions")
    # a questions file with no held-out question: named before anything starts
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "What is 1 plus 1?", "answer": "2"}\n')
    config = resolve("embedded", {"env.id": "qa", "env.options.questions": str(one)})
    with pytest.raises(PreflightError, match="test_fraction"):
        check_environment(config)
