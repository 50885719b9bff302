"""Environments: the countdown verifier against adversarial answers, scripted games of guess
the number, reasoning-gym data sets scored by their own verifiers, GEM through the adapter,
and a user's `module:Class`. All run in seconds, offline (importing reasoning-gym and gem
takes a few seconds once)."""

import json
import math
import random
import time
from fractions import Fraction

import numpy as np
import pytest

from agents.envs import EnvError, check_options, entry, known_ids, make_env
from agents.envs.countdown import CountdownOptions, judge_expression, make_problem, verify_expression
from agents.rewards import last_tagged


def play(env, actions):
    """Send `actions` until the episode ends; returns the (obs, reward, terminated, truncated, info) of each step."""
    steps = []
    for action in actions:
        steps.append(env.step(action))
        json.dumps(steps[-1][4])  # infos reach the tape
        if steps[-1][2] or steps[-1][3]:
            break
    return steps


def test_builtins_are_listed():
    ids = known_ids()
    for env_id in ("countdown", "game:guess_the_number", "rg:NAME", "gem:NAME", "module:NAME"):
        assert env_id in ids


# -- countdown: the verifier ------------------------------------------------------

N = [3, 7, 4]  # target 25 = 3 * 7 + 4


def refused(text, numbers=N, target=25):
    """The verdict on a wrong answer; asserts that it is one."""
    ok, value, reason = verify_expression(text, numbers, target)
    assert not ok, (text, value, reason)
    assert isinstance(reason, str) and reason
    return judge_expression(text, numbers, target)


def test_correct_answer():
    assert verify_expression("3*7+4", N, 25) == (True, Fraction(25), "correct")


def test_correct_answer_with_equals_target():
    assert verify_expression("3 * 7 + 4 = 25", N, 25)[0]


def test_equals_something_else_is_refused():
    assert refused("3 * 7 + 4 = 26").format_error


def test_latex_operators_are_accepted():
    assert verify_expression("3 \\times 7 + 4", N, 25)[0]
    assert verify_expression("(3 × 7) + 4.", N, 25)[0]
    assert verify_expression("\\left(8 \\div 4\\right) \\cdot 3", [8, 4, 3], 6)[0]


def test_parentheses_in_any_order_of_numbers():
    assert verify_expression("4 + (7 * 3)", N, 25)[0]


def test_fraction_intermediates_that_come_out_whole():
    assert verify_expression("(8 / 3) * 3", [8, 3, 3], 8) == (True, Fraction(8), "correct")
    assert verify_expression("6 / (1 - 3 / 4)", [6, 1, 3, 4], 24)[0]  # the classic 24 game trick


def test_wrong_value():
    verdict = refused("3 + 7 + 4")
    assert verdict.value == 14 and "equals 14, not 25" in verdict.reason and not verdict.format_error


def test_number_reused():
    verdict = refused("3 * 7 + 3 + 1", [3, 7, 1], 25)
    assert "uses 3 twice but it is given once" in verdict.reason and not verdict.format_error


def test_number_not_given():
    assert "uses 5, which is not given" in refused("3 * 7 + 4 + 5 - 5").reason


def test_number_missing():
    assert "does not use 4" in refused("3 * 7", N, 21).reason


def test_each_number_counted_as_a_multiset():
    assert verify_expression("3 * 3 + 4", [3, 3, 4], 13)[0]
    assert "uses 3 twice" in refused("3 * 3 + 4", [3, 4, 4], 13).reason


def test_concatenating_digits_is_not_using_the_numbers():
    assert "uses 37, which is not given" in refused("37 - 12", [3, 7, 12], 25).reason


def test_import_is_refused_unevaluated():
    assert refused("__import__('os').system('echo hacked')").format_error


def test_huge_power_is_refused_unevaluated():
    """9**9**9 would take longer than the universe's age to evaluate: refused without evaluating it. The
    bound is behaviour (it finished at all), not speed, so a busy machine does not fail it."""
    start = time.monotonic()
    assert refused("9**9**9", [9, 9, 9], 1).format_error
    assert time.monotonic() - start < 30


def test_power_is_refused():
    assert "Pow" in refused("2**3", [2, 3], 8).reason


def test_floor_division_and_modulo_are_refused():
    assert refused("8 // 4", [8, 4], 2).format_error
    assert refused("8 % 5", [8, 5], 3).format_error


def test_division_by_zero_is_a_wrong_answer():
    verdict = refused("8 / (3 - 3)", [8, 3, 3], 8)
    assert verdict.reason == "divides by zero" and not verdict.format_error


def test_empty_answer():
    assert refused("").format_error
    assert refused("   ").format_error
    assert refused(None).format_error


def test_unbalanced_parentheses():
    assert refused("(3 * 7 + 4").format_error
    assert refused("3 * 7) + 4").format_error


def test_empty_parentheses():
    assert refused("() + 25", [25], 25).format_error


def test_names_are_refused():
    assert refused("x + 25", [25], 25).format_error


def test_calls_are_refused():
    assert refused("max(3, 7) * 4 - 3", [3, 7, 4, 3], 25).format_error
    assert refused("abs(25)", [25], 25).format_error


def test_attribute_access_is_refused():
    assert refused("(25).real", [25], 25).format_error


def test_strings_and_lambdas_are_refused():
    assert refused("'25'", [25], 25).format_error
    assert refused("(lambda: 25)()", [25], 25).format_error


def test_huge_text_is_refused_before_parsing():
    assert "longer than" in refused("1 + " * 200 + "1", [1] * 201, 201).reason
    assert "longer than" in refused("(" * 10_000 + "1" + ")" * 10_000, [1], 1).reason


def test_deep_nesting_within_the_length_limit_is_handled():
    refused("(" * 99 + "25" + ")" * 99, [25], 24)  # parsed or refused, never a crash


def test_floats_are_refused():
    assert refused("2.5 * 10", [2, 10], 25).format_error
    assert refused("25.0", [25], 25).format_error
    assert refused("1e1 + 15", [10, 15], 25).format_error


def test_unary_minus_is_refused():
    assert "unary" in refused("-3 + 28", [3, 28], 25).reason
    assert refused("+25", [25], 25).format_error


def test_other_literals_are_refused():
    assert refused("0x19", [25], 25).format_error
    assert refused("2_5", [25], 25).format_error
    assert refused("025", [25], 25).format_error


# -- countdown: problems and episodes -------------------------------------------------


@pytest.mark.parametrize("count", [2, 3, 4, 6])
def test_every_target_is_reachable(count):
    options = CountdownOptions(numbers=count)
    for split in ("train", "test"):
        for seed in range(150):
            p = make_problem(options, split, 0, seed)
            assert len(p.numbers) == count and all(options.low <= n <= options.high for n in p.numbers)
            assert isinstance(p.target, int) and 1 <= p.target <= options.max_target
            assert verify_expression(p.solution, p.numbers, p.target)[0], p


def test_solution_scores_through_the_environment():
    env = make_env("countdown", {"numbers": 4}, split="train", run_seed=3)
    for seed in range(20):
        _, info = env.reset(seed)
        [(_, reward, terminated, truncated, info)] = play(env, [f"So: \\boxed{{{info['solution']}}}"])
        assert (reward, terminated, truncated, info["success"], info["format_error"]) == (1.0, True, False, True, False)


def test_first_observation_poses_the_problem():
    env = make_env("countdown")
    obs, info = env.reset(0)
    assert f"Using the numbers {info['numbers']}, each exactly once" in obs
    assert f"make {info['target']}." in obs and "\\boxed{}" in obs


def test_same_seed_same_problem_and_splits_differ():
    train, again = make_env("countdown", split="train"), make_env("countdown", split="train")
    test, other_run = make_env("countdown", split="test"), make_env("countdown", split="train", run_seed=1)
    assert [train.reset(s) for s in range(30)] == [again.reset(s) for s in range(30)]

    def problem(env, seed):
        info = env.reset(seed)[1]
        return tuple(sorted(info["numbers"])), info["target"]

    train_problems = {problem(train, s) for s in range(300)}
    assert not train_problems & {problem(test, s) for s in range(300)}  # held out by a hash of the problem
    assert [problem(train, s) for s in range(30)] != [problem(other_run, s) for s in range(30)]


def test_wrong_and_unreadable_answers():
    env = make_env("countdown")
    env.reset(0)
    [(_, reward, terminated, _, info)] = play(env, ["\\boxed{1 + 1}"])
    assert (reward, terminated, info["success"], info["format_error"]) == (0.0, True, False, False)
    env.reset(0)
    [(_, reward, terminated, _, info)] = play(env, ["the answer is 25"])
    assert (reward, terminated, info["success"], info["format_error"]) == (-0.1, True, False, True)


def test_more_turns_give_feedback_and_go_on():
    env = make_env("countdown", {"max_turns": 3, "reward_format_error": -0.5})
    _, info = env.reset(4)
    numbers, target = info["numbers"], info["target"]
    wrong = " + ".join(map(str, numbers))
    total = sum(numbers)
    steps = play(env, [f"\\boxed{{{wrong}}}", "no box", f"\\boxed{{{info['solution']}}}"])
    if total == target:
        pytest.skip("the sum happens to be the target")
    assert steps[0][0] == f"Your expression equals {total}, not {target}. Try again."
    assert [s[1] for s in steps] == [0.0, -0.5, 1.0]
    assert [s[2] for s in steps] == [False, False, True]
    assert steps[-1][4]["success"] and steps[1][4]["format_error"]


def test_out_of_tries_ends_the_episode():
    env = make_env("countdown", {"max_turns": 2})
    env.reset(0)
    steps = play(env, ["\\boxed{1+1}", "\\boxed{1+1}", "\\boxed{1+1}"])
    assert len(steps) == 2 and steps[-1][2] and "No tries left" in steps[-1][0]


def test_countdown_options_are_checked():
    with pytest.raises(EnvError, match="options.numbers"):
        check_options("countdown", {"numbers": 7})
    with pytest.raises(EnvError, match="options.bogus"):
        check_options("countdown", {"bogus": 1})
    with pytest.raises(EnvError, match="max_target"):
        check_options("countdown", {"high": 500, "numbers": 6})


# -- guess the number --------------------------------------------------------------


def guess_env(**options):
    return make_env("game:guess_the_number", options, split="train", run_seed=0)


def binary_search(env, low=1, high=10, limit=10):
    steps = []
    while len(steps) < limit:
        guess = (low + high) // 2
        steps.append(env.step(f"My guess: \\boxed{{{guess}}}"))
        obs = steps[-1][0]
        if steps[-1][2] or steps[-1][3]:
            return steps
        low, high = (guess + 1, high) if "higher" in obs else (low, guess - 1)
    raise AssertionError("the game never ended")


def test_binary_search_wins_every_held_out_game():
    env = make_env("game:guess_the_number", split="test", run_seed=5)
    assert env.test_size == 10
    targets = []
    for seed in range(env.test_size):
        _, info = env.reset(seed)
        targets.append(info["target"])
        steps = binary_search(env)
        assert len(steps) <= 4
        assert [s[1] for s in steps] == [0.0] * (len(steps) - 1) + [1.0]
        assert steps[-1][2] and not steps[-1][3] and steps[-1][4]["success"]
    assert sorted(targets) == list(range(1, 11))  # the held-out games take every number once


def test_first_observation_explains_the_game():
    obs, _ = guess_env().reset(0)
    assert obs == ("I am thinking of a number between 1 and 10. You have 4 guesses. After each guess I say whether "
                   "the number is higher or lower. Put your guess in \\boxed{}, e.g. \\boxed{5}.")  # fmt: skip


def test_reward_sequence_and_hints():
    env = guess_env()
    target = next(t for s in range(50) if 3 <= (t := env.reset(s)[1]["target"]) <= 8)
    steps = play(env, ["\\boxed{1}", "\\boxed{10}", f"\\boxed{{{target}}}"])
    assert steps[0][0] == "Your guess 1 is too low: the number is higher than 1. 3 guesses left."
    assert steps[1][0] == "Your guess 10 is too high: the number is lower than 10. 2 guesses left."
    assert [s[1:4] for s in steps] == [(0.0, False, False), (0.0, False, False), (1.0, True, False)]
    assert [s[4]["success"] for s in steps] == [False, False, True]


def test_out_of_guesses_loses_the_game():
    env = guess_env()
    target = env.reset(1)[1]["target"]
    wrong = 1 if target != 1 else 2
    steps = play(env, [f"\\boxed{{{wrong}}}"] * 6)
    assert len(steps) == 4 and [s[1] for s in steps] == [0.0] * 4
    obs, _, terminated, truncated, info = steps[-1]
    assert terminated and not truncated and not info["success"]
    assert f"You are out of guesses: the number was {target}." in obs


def test_an_out_of_range_guess_counts():
    env = guess_env()
    env.reset(0)
    [(obs, reward, terminated, _, info)] = play(env, ["\\boxed{11}"])
    assert "outside the range 1 to 10; it still counts as a guess" in obs and "3 guesses left" in obs
    assert (reward, terminated, info["format_error"]) == (0.0, False, False)


def test_an_unreadable_guess_ends_the_game_by_default():
    env = guess_env()
    target = env.reset(0)[1]["target"]
    for action in ["I guess five", "\\boxed{five}", "\\boxed{5.5}", "\\boxed{}"]:
        env.reset(0)
        [(obs, reward, terminated, _, info)] = play(env, [action])
        assert (reward, terminated, info["success"], info["format_error"]) == (-0.1, True, False, True), action
        assert f"the number was {target}" in obs


def test_an_unreadable_guess_can_use_up_a_turn_instead():
    env = guess_env(invalid_ends_episode=False, reward_invalid=-0.2)
    env.reset(0)
    steps = play(env, ["no idea"] * 5)
    assert [s[1] for s in steps] == [-0.2] * 4 and [s[2] for s in steps] == [False, False, False, True]
    assert "It counts as a guess. 3 guesses left." in steps[0][0]


def test_range_feedback_says_where_the_number_still_is():
    env = guess_env(feedback="range", low=1, high=20, max_turns=6)
    target = next(t for s in range(100) if 8 <= (t := env.reset(s)[1]["target"]) <= 12)
    steps = play(env, ["\\boxed{3}", "\\boxed{15}", "\\boxed{25}", "\\boxed{1}", "oops"])
    assert steps[0][0] == "3 is too low. The number is between 4 and 20. 5 guesses left."
    assert steps[1][0] == "15 is too high. The number is between 4 and 14. 4 guesses left."
    # a guess outside the range, or one already ruled out, leaves the known range as it was
    assert steps[2][0] == (
        "Your guess 25 is outside the range 1 to 20; it still counts as a guess. "
        "The number is between 4 and 14. 3 guesses left."
    )
    assert steps[3][0] == "1 is too low. The number is between 4 and 14. 2 guesses left."
    assert steps[4][2] and f"the number was {target}" in steps[4][0]  # unreadable: the game ends as with direction
    seed = next(s for s in range(100) if 2 <= env.reset(s)[1]["target"] <= 19)
    target = env.reset(seed)[1]["target"]
    steps = play(env, [f"\\boxed{{{target - 1}}}", f"\\boxed{{{target + 1}}}"])
    assert steps[1][0].endswith(f"The number can only be {target}. 4 guesses left.")


def test_narrowing_reward_pays_the_bits_each_guess_rules_out():
    env = guess_env(low=1, high=16, max_turns=6, reward_narrowing=0.5)
    env.reset(0)
    env.target = 11
    steps = play(env, ["\\boxed{8}", "\\boxed{12}", "\\boxed{9}", "\\boxed{13}", "\\boxed{11}"])
    # 16 -> 8 candidates (1 bit of 4), 8 -> 3 (9..11), 3 -> 2 (9 rules out one), 13 is already ruled out (0),
    # and the right guess leaves 1 of 2; the won game collects 0.5 in all, besides reward_correct
    bits = [1, math.log2(8 / 3), math.log2(3 / 2), 0, 1]
    assert [s[1] for s in steps] == pytest.approx([0.5 * b / 4 for b in bits[:4]] + [1.0 + 0.5 * bits[4] / 4])
    assert sum(s[1] for s in steps) == pytest.approx(1.5)
    # a lost game collects the share of the range it ruled out; a scan by one earns less than bisection
    env.reset(0)
    env.target = 16
    lost = play(env, [f"\\boxed{{{g}}}" for g in (1, 2, 3, 4, 5, 6)])
    assert lost[-1][2] and sum(s[1] for s in lost) == pytest.approx(0.5 * math.log2(16 / 10) / 4)
    env.reset(0)
    env.target = 16
    halving = play(env, [f"\\boxed{{{g}}}" for g in (8, 12, 14, 15)])
    assert sum(s[1] for s in halving[:3]) == pytest.approx(0.5 * 3 / 4)
    assert sum(s[1] for s in halving[:3]) > sum(s[1] for s in lost)
    # off by default: the rewards stay GEM's
    plain = guess_env(low=1, high=16, max_turns=6)
    plain.reset(0)
    plain.target = 11
    assert [s[1] for s in play(plain, ["\\boxed{8}", "\\boxed{11}"])] == [0.0, 1.0]


def test_narrowing_reward_is_checked():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(EnvError, match="reward_narrowing"):
            guess_env(reward_narrowing=bad)


def test_range_feedback_last_guess_says_no_range():
    env = guess_env(feedback="range")
    target = env.reset(2)[1]["target"]
    wrong = 1 if target != 1 else 2
    obs = play(env, [f"\\boxed{{{wrong}}}"] * 4)[-1][0]
    assert "between" not in obs and f"You are out of guesses: the number was {target}." in obs


def test_guess_the_number_is_seeded():
    a, b = guess_env(), guess_env()
    targets = [a.reset(s)[1]["target"] for s in range(40)]
    assert targets == [b.reset(s)[1]["target"] for s in range(40)]
    assert len(set(targets)) > 5
    other = make_env("game:guess_the_number", split="train", run_seed=1)
    assert targets != [other.reset(s)[1]["target"] for s in range(40)]


def test_guess_options_are_checked():
    with pytest.raises(EnvError, match="low"):
        check_options("game:guess_the_number", {"low": 10, "high": 5})


# -- rg: reasoning-gym --------------------------------------------------------------

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
         "allow_negation": False, "test_size": 20}  # fmt: skip


def test_reasoning_gym_scores_its_own_gold_answer():
    env = make_env("rg:basic_arithmetic", split="train", run_seed=0)
    obs, info = env.reset(0)
    assert obs.endswith("Put your final answer in \\boxed{}.")
    gold = info["answer"]
    [(_, reward, terminated, _, step_info)] = play(env, [f"The answer is \\boxed{{{gold}}}."])
    assert (reward, terminated, step_info["success"], step_info["format_error"]) == (1.0, True, True, False)
    env.reset(0)
    [(_, reward, _, _, step_info)] = play(env, [f"\\boxed{{{int(gold) + 1}}}"])
    assert reward < 1.0 and not step_info["success"]
    env.reset(0)
    [(_, reward, _, _, step_info)] = play(env, ["I do not know"])
    assert reward < 1.0 and step_info["format_error"] and not step_info["success"]


def test_reasoning_gym_options_reach_the_data_set():
    env = make_env("rg:basic_arithmetic", SMALL, split="test", run_seed=0)
    assert env.test_size == 20
    for seed in range(20):
        question = env.reset(seed)[0]
        expression = question.split("\n")[0]  # "Calculate 3 + -4."
        assert expression.count(" + ") == 1 and not any(op in expression for op in ("*", "/", " - ")), question


def test_reasoning_gym_splits_share_no_question_and_are_seeded():
    test = make_env("rg:basic_arithmetic", SMALL, split="test", run_seed=0)
    train = make_env("rg:basic_arithmetic", SMALL, split="train", run_seed=0)
    test_questions = {test.reset(s)[0] for s in range(20)}
    train_questions = [train.reset(s)[0] for s in range(100)]
    assert not test_questions & set(train_questions)  # a space of 100 questions: they would collide otherwise
    again = make_env("rg:basic_arithmetic", SMALL, split="train", run_seed=0)
    assert train_questions[:10] == [again.reset(s)[0] for s in range(10)]
    other_run = make_env("rg:basic_arithmetic", SMALL, split="train", run_seed=1)
    assert train_questions[:10] != [other_run.reset(s)[0] for s in range(10)]


def test_unknown_reasoning_gym_data_set_is_refused():
    with pytest.raises(EnvError, match="unknown reasoning-gym data set 'basic_arithmatic'.*basic_arithmetic"):
        entry("rg:basic_arithmatic")
    with pytest.raises(EnvError, match="unknown reasoning-gym"):
        check_options("rg:no_such_thing", {})


def test_reasoning_gym_options_are_checked():
    with pytest.raises(EnvError, match="options.min_termz"):
        check_options("rg:basic_arithmetic", {"min_termz": 2})
    with pytest.raises(EnvError, match="min_terms must be positive"):
        check_options("rg:basic_arithmetic", {"min_terms": 0})
    with pytest.raises(EnvError, match="seed is not an option"):
        check_options("rg:basic_arithmetic", {"seed": 1})


# -- gem: GEM through the adapter -----------------------------------------------------


@pytest.fixture(scope="module")
def gem_installed():
    try:
        import gem  # noqa: F401
    except ImportError as exc:
        pytest.fail(
            f"gem-llm is not installed ({exc}): run `uv sync --extra gem` "
            "(the tests run as `uv run --extra gem pytest`)"
        )


GTN = "gem:game:GuessTheNumber-v0-easy"


def test_gem_guess_the_number_is_won_by_binary_search(gem_installed):
    env = make_env(GTN, split="train", run_seed=0)
    obs, info = env.reset(0)
    assert "Guess The Number" in obs and "between 1 and 10" in obs
    json.dumps(info)
    steps = binary_search(env)
    assert len(steps) <= 4 and steps[-1][1] == 1.0 and steps[-1][2] and steps[-1][4]["success"]
    assert all(s[1] == 0.0 and not s[4]["success"] for s in steps[:-1])


def test_gem_lost_game_is_no_success_despite_its_reward(gem_installed):
    env = make_env(GTN, split="train", run_seed=0)
    env.reset(2)
    target = env.env.game_number
    wrong = 1 if target != 1 else 10
    steps = play(env, [f"\\boxed{{{wrong}}}"] * 4)
    _, reward, terminated, truncated, info = steps[-1]
    assert terminated and truncated and reward > 0  # GEM pays for a close last guess
    assert info["success"] is False


def test_gem_unboxed_guess_ends_the_episode(gem_installed):
    env = make_env(GTN, split="train", run_seed=0)
    env.reset(0)
    [(_, reward, terminated, _, info)] = play(env, ["five"])
    assert (reward, terminated, info["success"]) == (-0.1, True, False)


def test_gem_is_seeded_and_leaves_the_global_generators_alone(gem_installed):
    make_env(GTN)  # imports gem (which may draw numbers while importing)
    random.seed(7)
    np.random.seed(7)
    expected = (random.random(), np.random.rand())
    random.seed(7)
    np.random.seed(7)
    a, b = make_env(GTN, split="train", run_seed=0), make_env(GTN, split="train", run_seed=0)
    test = make_env(GTN, split="test", run_seed=0)
    targets = []
    for s in range(20):  # interleaved, as the loop plays episodes
        a.reset(s)
        b.reset(s)
        test.reset(s)
        targets.append((a.env.game_number, b.env.game_number, test.env.game_number))
    assert (random.random(), np.random.rand()) == expected
    assert all(x == y for x, y, _ in targets) and len({x for x, _, _ in targets}) > 3
    assert [x for x, _, _ in targets] != [z for _, _, z in targets]


def test_unknown_gem_id_is_refused(gem_installed):
    with pytest.raises(EnvError, match="game:GuessTheNumber-v0-easy"):
        entry("gem:game:GuessTheNumber")


# -- module:Class --------------------------------------------------------------------


class EchoEnv:
    """Say the word."""

    def __init__(self, split="train", run_seed=0, word="hello"):
        self.split, self.run_seed, self.word = split, run_seed, word

    def reset(self, seed=None):
        return f"Say {self.word} ({self.split}, run {self.run_seed}, episode {seed})", {}

    def step(self, action):
        ok = action.strip() == self.word
        return "", float(ok), True, False, {"success": ok}


class NotAnEnv:
    pass


def test_module_class():
    env = make_env(f"module:{__name__}:EchoEnv", {"word": "yo"}, split="test", run_seed=4)
    assert env.reset(2)[0] == "Say yo (test, run 4, episode 2)"
    assert env.step("yo")[1] == 1.0 and env.step("no")[1] == 0.0


def test_module_class_that_is_no_environment_is_refused():
    with pytest.raises(EnvError, match="no reset"):
        make_env(f"module:{__name__}:NotAnEnv")
    with pytest.raises(EnvError, match="cannot import"):
        entry(f"module:{__name__}:Missing")


# -- capabilities: what an environment offers beyond reset / step ---------------------------------


class _AsyncEnv:
    """A user's environment whose step blocks, offered without blocking as astep."""

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        return "done", 1.0, True, False, {}

    async def astep(self, action):
        return self.step(action)


class _GemLike:
    """A GEM-style environment whose unrelated attributes share capability names: none of them is one."""

    test_size = True  # a flag, not a number of episodes
    tool_call = None

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        return "done", 0.0, True, False, {}

    def stop(self):  # a method, not stop strings
        pass


def test_capabilities_of_a_plain_a_tool_and_an_async_environment():
    from agents.envs import Capabilities, capabilities
    from agents.sandbox import Sandbox
    from agents.tools import PythonTool, ToolEnv

    plain = make_env("math:arithmetic", split="test")
    assert capabilities(plain) == Capabilities(test_size=500)
    tools = ToolEnv(plain, [PythonTool(Sandbox())])  # the wrapper offers the wrapped env's held-out size too
    assert capabilities(tools) == Capabilities(
        test_size=500, stop=("</python>", "</tool_call>"), tool_calls=True, async_step=True
    )
    assert capabilities(_AsyncEnv()) == Capabilities(async_step=True)
    assert capabilities(_GemLike()) == Capabilities()
    assert capabilities(make_env("countdown", split="test")) == Capabilities()  # procedural: test_size None


def test_timed_env_offers_exactly_what_it_wraps():
    import asyncio

    from agents.envs import capabilities
    from agents.sandbox import Sandbox
    from agents.tools import PythonTool, ToolEnv
    from orchestrate.loop.rollouts import EnvClock, TimedEnv

    clock = EnvClock()
    for env in (make_env("math:arithmetic", split="test"), ToolEnv(make_env("countdown"), [PythonTool(Sandbox())]),
                _AsyncEnv(), _GemLike(), make_env("code", split="test")):  # fmt: skip
        assert capabilities(TimedEnv(env, clock)) == capabilities(env)
    assert capabilities(TimedEnv(make_env("code"), clock)).workspace  # a harness's task files pass through
    timed = TimedEnv(make_env("math:arithmetic"), clock)
    assert not hasattr(timed, "astep") and not hasattr(timed, "tool_call") and not hasattr(timed, "stop")
    timed = TimedEnv(_AsyncEnv(), clock)
    assert asyncio.run(timed.astep("x"))[1] == 1.0 and clock.busy_s > 0  # the async step is timed too


def test_tags_framing_judges_the_last_answer_tag():
    env = make_env("countdown", {"answer": "tags", "reward_wrong": 0.1, "reward_format_error": 0.0})
    obs, info = env.reset(0)
    assert "<answer> </answer>" in obs and "<think> </think>" in obs and "\\boxed" not in obs
    right, numbers = info["solution"], info["numbers"]
    [(_, reward, _, _, step)] = play(env, [f"<think>try</think> <answer>1 + 1</answer> <answer> {right} </answer>"])
    assert (reward, step["success"]) == (1.0, True)
    env.reset(0)
    wrong = " + ".join(map(str, numbers)) if sum(numbers) != info["target"] else " * ".join(map(str, numbers))
    [(_, reward, _, _, step)] = play(env, [f"<think>x</think><answer>{wrong}</answer>"])
    assert (reward, step["success"], step["format_error"]) == (0.1, False, False)  # the format reward
    for unreadable in (f"\\boxed{{{right}}}", f"<answer>{right}", f"{right}</answer>"):
        env.reset(0)
        [(_, reward, _, _, step)] = play(env, [unreadable])
        assert (reward, step["format_error"], step["reason"]) == (0.0, True, "no <answer> </answer> tags"), unreadable


def test_last_tagged():
    assert last_tagged("<answer>1</answer> then <answer> 2 + 3 </answer>") == "2 + 3"
    assert last_tagged("<answer>1</answer> <answer>2") == "1"  # the last closed one
    assert last_tagged("</answer><answer>") is None and last_tagged("none") is None
