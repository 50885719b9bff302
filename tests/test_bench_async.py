"""bench/bench_async.py's schedule model: the loop's order of work on two devices, worked by hand."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("bench_async", Path(__file__).parent.parent / "bench" / "bench_async.py")
bench_async = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_async)
schedule_seconds = bench_async.schedule_seconds


def test_level_0_is_every_phase_one_after_another():
    phases = [(2.0, 3.0, 0.0), (2.0, 3.0, 4.0), (2.0, 3.0, 0.0)]
    assert schedule_seconds(phases, 0) == pytest.approx(19.0)  # 3 x (2 + 3) + 4


def test_level_1_overlaps_after_the_first_batch():
    # gen 1 ends at 2, trains to 5; gen 2 ends at 4, trains 5-8; gen 3 ends at 7, trains 8-11
    assert schedule_seconds([(2.0, 3.0, 0.0)] * 3, 1) == pytest.approx(11.0)  # G + N T
    # training the shorter side: generation paces it, and the last batch still trains after it: 3 x 3 + 2
    assert schedule_seconds([(3.0, 2.0, 0.0)] * 3, 1) == pytest.approx(11.0)


def test_an_evaluation_stops_the_generator_once_its_checkpoint_is_written():
    # record 2 (with its 4 s evaluation) waits for checkpoint 2 (at 8), after batch 3 was generated (at 7)
    assert schedule_seconds([(2.0, 3.0, 0.0), (2.0, 3.0, 4.0), (2.0, 3.0, 0.0)], 1) == pytest.approx(12.0)


def test_level_k_waits_for_checkpoint_i_minus_1_minus_k():
    # generation three times faster than training: level 1 generates at most one batch ahead of the trainer,
    # level 2 two; on 4 batches both end when the trainer does (G + 4 T), but level 0 pays every G
    phases = [(1.0, 3.0, 0.0)] * 4
    assert schedule_seconds(phases, 0) == pytest.approx(16.0)
    assert schedule_seconds(phases, 1) == pytest.approx(13.0)
    assert schedule_seconds(phases, 2) == pytest.approx(13.0)
