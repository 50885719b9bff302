"""bench/bench_trees.py's comparison at equal held-out success."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_trees import TREE_OPTIONS, tokens_at_equal_success  # noqa: E402


def point(iteration, success, tokens):
    return {"iteration": iteration, "minutes": iteration * 2.0, "success": success, "tokens": tokens, "env_steps": 0}


def test_tokens_at_equal_success_take_the_lower_best_and_each_arms_first_reach():
    runs = {
        "chain": {"curve": [point(0, 0.2, 0), point(1, 0.5, 1000), point(2, 0.8, 2000), point(3, 1.0, 3000)]},
        "tree": {"curve": [point(0, 0.2, 0), point(1, 0.8, 900), point(2, 0.7, 1800)]},
    }
    # the lower of the two bests (the tree's 0.8), each run's first point at it
    out = tokens_at_equal_success(runs)
    assert out["success"] == 0.8
    assert out["chain"]["tokens"] == 2000 and out["tree"]["tokens"] == 900
    assert out["token_ratio"] == 0.45
    assert tokens_at_equal_success({"chain": runs["chain"]}) is None
    assert tokens_at_equal_success({**runs, "tree": {"curve": [point(0, 0.2, 0)]}}) is None
    # a run that never beat the untrained model: no success both reached by training
    flat = {"curve": [point(0, 0.2, 0), point(1, 0.2, 1000), point(2, 0.1, 2000)]}
    assert tokens_at_equal_success({**runs, "chain": flat}) is None


def test_every_presets_tree_options_pass_the_loops_checks():
    from orchestrate.loop.command_line import load_preset, resolve_from
    from orchestrate.loop.config_checks import check_config

    for preset, options in TREE_OPTIONS.items():
        overrides = {options[i].removeprefix("--"): options[i + 1] for i in range(0, len(options), 2)}
        config = resolve_from(load_preset(preset), overrides, f"preset {preset!r}")
        check_config(config)  # a single-turn episode, a width below 2, a budget below one root: ConfigError
        assert config.tree.width >= 2 and config.train.estimator == "tree", preset
