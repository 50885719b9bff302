"""Progress in a log is a few lines, on a terminal a tqdm bar: orchestrate.loop.progress.progress_bar."""

from __future__ import annotations

import io
import os
import pty

from orchestrate.loop.progress import LineProgress, progress_bar


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_at_most_one_line_every_30_s_and_one_at_the_end():
    """10,000 updates over 10 simulated minutes: 20 interval lines + 1 final line, not a refresh per update."""
    log, clock = io.StringIO(), FakeClock()
    bar = LineProgress(total=10_000, desc="iteration 1 rollouts", unit="episode", file=log, clock=clock)
    for _ in range(10_000):
        clock.now += 0.06
        bar.update(1)
    bar.close()
    bar.close()  # closing twice writes nothing more
    lines = log.getvalue().splitlines()
    assert 20 <= len(lines) <= 21, lines
    assert len(log.getvalue()) < 2000
    assert lines[0].startswith("iteration 1 rollouts: ") and lines[0].endswith(" episode [30 s]")
    assert lines[-1] == "iteration 1 rollouts: 10000/10000 episode, done in 600 s"
    assert "\r" not in log.getvalue()


def test_progress_bar_writes_plain_lines_to_a_stream_that_is_not_a_terminal():
    log = io.StringIO()
    items = list(progress_bar(range(5000), desc="rescore", unit="tape", file=log, leave=False))
    assert items == list(range(5000))
    assert log.getvalue() == "rescore: 5000/5000 tape, done in 0 s\n"  # iterating to the end closes it
    with progress_bar(desc="train: starting", bar_format="{desc} [{elapsed}]", file=log) as bar:
        for status in ("loading", "training", "saving") * 1000:
            bar.set_description_str("train: " + status)
    assert log.getvalue().splitlines()[1] == "train: saving, done in 0 s"
    log = io.StringIO()
    with progress_bar(total=10, desc="x", disable=True, file=log) as bar:
        bar.update(10)
    assert log.getvalue() == ""  # disabled: nothing, as before


def test_a_terminal_still_gets_the_bar():
    main, child = pty.openpty()
    with os.fdopen(child, "w") as tty:
        assert tty.isatty()
        bar = progress_bar(total=40, desc="reference", unit="call", file=tty, mininterval=0, miniters=1)
        for _ in range(40):
            bar.update(1)
        bar.close()
    out = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the terminal's other end is closed and everything was read
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    text = out.decode()
    assert "\r" in text and "reference:" in text and "40/40" in text and "call/s" in text  # tqdm's redrawn bar
    assert text.count("\r") > 10
