"""Progress where stderr is not a terminal (nohup, Slurm, CI): lychee_exp.io.progress logs a line with the count,
the rate and the time left every 30 s or tenth of a phase (never twice within 10 s), on a simulated clock; a
terminal still gets tqdm's bar; progress_bar=false shows neither. Then the phases that use it: a real rerank run's
stderr file (the acceptance: a line at least every 30 s), mining, dense encoding, and a training run's dev
evaluation, training lines and step rows."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest
import tqdm.std
from beir_helpers import fruit_dataset

from lychee_exp.io import progress as progress_module
from lychee_exp.io.progress import LogLines, progress_meter, progress_shown, row_eta

LINE = re.compile(r"^(?P<desc>.+): (?P<n>[\d,]+)/(?P<total>[\d,]+) (?P<units>\w+) \((?P<pct>\d+)%\), ")
RATE_LEFT = re.compile(r", [\d,.]+ (\w+/s|s/\w+), (?P<left>\d\d:\d\d) left, (?P<elapsed>\d\d:\d\d) elapsed")


class Clock:
    """tqdm's clock, by hand: `now` moves only when the test says (or by `tick` at every reading)."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)  # what every tqdm made from here on reads as its time
    return clock


@pytest.fixture
def no_terminal(monkeypatch) -> io.StringIO:
    stderr = io.StringIO()  # isatty() is False: as under nohup, Slurm or CI
    monkeypatch.setattr(sys, "stderr", stderr)
    return stderr


@pytest.fixture
def lines(clock):
    """The progress lines logged, each with the simulated time it was logged at."""
    got: list[tuple[float, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append((clock.now, record.getMessage()))

    logger = logging.getLogger(progress_module.__name__)
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield got
    logger.removeHandler(handler)
    logger.setLevel(level)


def _phase(clock: Clock, total: int, batch: int, seconds_per_batch: float, desc: str = "rerank test") -> None:
    bar = progress_meter(desc=desc, unit="pair", total=total)
    assert isinstance(bar, LogLines)
    for _ in range(0, total, batch):
        clock.now += seconds_per_batch
        bar.update(batch)
    bar.close()


def test_a_long_phase_logs_a_line_every_30_s_with_its_rate_and_time_left(no_terminal, clock, lines):
    # 5,600 pairs in 140 batches of 40, one every 2.5 s (16 pairs/s): 350 s, a tenth every 35 s
    start = clock.now
    _phase(clock, 5600, 40, 2.5)
    *running, (_, last) = lines
    times = [start] + [t for t, _ in running]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(running) == 11 and all(30 <= gap <= 32.5 for gap in gaps), gaps  # the 30 s rule, batch by batch
    for at, line in running:
        n = int(LINE.match(line)["n"].replace(",", ""))
        assert line.startswith(f"rerank test: {n:,}/5,600 pairs ({100 * n / 5600:.0f}%), 16.0 pairs/s, ")
        left = RATE_LEFT.search(line)
        assert left["left"] == tqdm.std.tqdm.format_interval((5600 - n) / 16)  # at the rate since the last line
        assert left["elapsed"] == tqdm.std.tqdm.format_interval(at - start)
    assert last == "rerank test: 5,600/5,600 pairs (100%), 16.0 pairs/s, done in 05:50"
    assert no_terminal.getvalue() == ""  # no bar, nor tqdm's carriage returns, on stderr


def test_a_shorter_phase_logs_each_tenth_but_never_twice_within_10_s(no_terminal, clock, lines):
    _phase(clock, 100, 1, 1.5)  # 150 s: a tenth every 15 s, before 30 s have passed
    counts = [int(LINE.match(line)["n"]) for _, line in lines[:-1]]
    assert counts == [10, 20, 30, 40, 50, 60, 70, 80, 90]
    lines.clear()
    start = clock.now
    _phase(clock, 600, 1, 0.1)  # 60 s: a tenth every 6 s, too often: one line per 10 s
    times = [start] + [t for t, _ in lines[:-1]]
    assert len(times) == 6 and all(b - a == pytest.approx(10, abs=0.11) for a, b in zip(times, times[1:]))


def test_a_phase_of_a_few_seconds_logs_nothing(no_terminal, clock, lines):
    _phase(clock, 100, 1, 0.09)  # 9 s
    assert lines == []


def test_a_terminal_gets_tqdms_bar_and_no_lines(monkeypatch, clock, lines):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = progress_meter(desc="rerank test", unit="pair", total=50)
    assert type(bar) is tqdm.std.tqdm
    for _ in range(5):
        clock.now += 20
        bar.update(10)
    bar.close()
    assert "rerank test: 100%" in terminal.getvalue() and "50/50" in terminal.getvalue() and lines == []
    assert row_eta(bar) == ""  # the bar shows the time left: a training row need not


def test_progress_bar_false_shows_neither_bar_nor_lines(no_terminal, clock, lines):
    with progress_shown(False):
        _quiet = progress_meter(desc="encode passages", unit="text", total=10)
        assert _quiet.disable
    bar = progress_meter(desc="rerank test", unit="pair", total=10, shown=False)  # e.g. a rank other than 0
    for quiet in (_quiet, bar):
        for _ in range(10):
            clock.now += 20
            quiet.update(1)
        quiet.close()
    assert lines == [] and no_terminal.getvalue() == "" and row_eta(bar) == ""


def test_a_training_row_says_the_time_left_and_counts_as_a_line(no_terminal, clock, lines):
    bar = progress_meter(desc="train", unit="step", total=100, rows_every=8)
    for step in range(1, 21):
        clock.now += 4  # 4 s a step: a tenth (10 steps) every 40 s, so the 30 s rule
        bar.update(1)
        if step % 8 == 0:  # as the trainer's log_every: the row after the step's update
            assert row_eta(bar) == f" | {tqdm.std.tqdm.format_interval(4 * (100 - step))} left"
    bar.close()
    steps = [int(LINE.match(line)["n"]) for _, line in lines[:-1]]
    # no line at step 8 (its 32 s are the row's), none within 30 s of a row: 15 (28 s after 8's row), 16 is a row
    assert steps == []
    assert lines[-1][1] == "train: 20/100 steps (20%), 4.0 s/step, stopped after 01:20"
    lines.clear()
    bar = progress_meter(desc="train", unit="step", total=100, rows_every=10)
    for step in range(1, 21):
        clock.now += 4
        bar.update(1)
        if step % 10 == 0:
            row_eta(bar)
    bar.close()
    steps = [int(LINE.match(line)["n"]) for _, line in lines[:-1]]
    assert steps == [8, 18]  # 32 s after the start, and after step 10's row
    assert all(RATE_LEFT.search(line) and "4.0 s/step" in line for _, line in lines[:-1])


# ---------------------------------------------------------------------------------------------- the phases


TICKING = """
import itertools, sys, tqdm.std
ticks = itertools.count()
tqdm.std.time = lambda: 1000.0 + 4.0 * next(ticks)  # every reading of tqdm's clock 4 s later
from lychee_exp.rerank import main
main(sys.argv[1:])
"""


def test_a_rerank_whose_stderr_is_a_file_logs_its_progress_there_at_least_every_30_s(tmp_path, ir_cache):
    """The acceptance, on a real run: `rerank ... 2> file` (nohup, Slurm) and a clock that runs fast."""
    root = fruit_dataset(tmp_path / "fruit")
    args = [f"dataset={root}", f"out={tmp_path / 'out'}", "split=test", "top_k=6", "batch_size=2"]
    args += ["model=tiny_lychee", "model.random_init=true", "parallel.cpu_threads_per_rank=1"]
    with (tmp_path / "stderr.log").open("w") as stderr:
        done = subprocess.run([sys.executable, "-c", TICKING, *args], stderr=stderr, timeout=300)
    log = (tmp_path / "stderr.log").read_text()
    assert done.returncode == 0, log
    ours = [line for line in log.splitlines() if "[lychee_exp.io.progress][INFO] - rerank test: " in line]
    assert len(ours) == len(set(ours)) >= 3, log  # each once, with the log's timestamp
    running = [line for line in ours if RATE_LEFT.search(line)]
    elapsed = [0] + [_seconds(RATE_LEFT.search(line)["elapsed"]) for line in running]
    assert len(running) >= 2 and all(b - a <= 30 for a, b in zip(elapsed, elapsed[1:])), ours
    assert "36/36 pairs (100%)" in ours[-1] and "done in" in ours[-1]
    assert "\r" not in log and "|#" not in log  # no bar written to a file


def _seconds(clock_text: str) -> int:
    minutes, seconds = clock_text.split(":")
    return 60 * int(minutes) + int(seconds)


@pytest.fixture
def ticking(monkeypatch) -> Clock:
    clock = Clock(tick=4.0)
    monkeypatch.setattr(tqdm.std, "time", clock)
    return clock


def test_mining_logs_its_progress(tmp_path, ir_cache, no_terminal, ticking, caplog):
    from lychee_exp.mine import main as mine_main

    root = fruit_dataset(tmp_path / "fruit")
    args = [f"dataset={root}", f"out={tmp_path / 'train.jsonl'}", "split=train", "teacher=none"]
    with caplog.at_level(logging.INFO, logger=progress_module.__name__):
        mine_main([*args, "range_min=1", "range_max=10", "num_negatives=3"])
    mined = [r.getMessage() for r in caplog.records if r.name == progress_module.__name__]
    assert any(m.startswith("mine train: ") and "/6 queries (" in m and RATE_LEFT.search(m) for m in mined), mined
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=progress_module.__name__):
        mine_main([*args, "range_min=1", "range_max=10", "num_negatives=3", "overwrite=true", "progress_bar=false"])
    assert not [r for r in caplog.records if r.name == progress_module.__name__]


def test_dense_encoding_logs_its_progress(tmp_path, ir_cache, no_terminal, ticking, caplog):
    from lychee_exp.config.schema import DenseConfig
    from lychee_exp.ir.dense import embed

    with caplog.at_level(logging.INFO, logger=progress_module.__name__):
        embed([f"text number {i}" for i in range(40)], DenseConfig(batch_size=4), what="passages")
    said = [r.getMessage() for r in caplog.records if r.name == progress_module.__name__]
    assert any(m.startswith("encode passages: ") and RATE_LEFT.search(m) for m in said), said
    assert said[-1].startswith("encode passages: 40/40 passages (100%)")


def test_a_training_run_logs_its_evaluation_and_training_progress_and_rows_say_the_time_left(
    tmp_path, no_terminal, ticking, caplog
):
    from conftest import run_tiny

    # 4 steps an epoch, each epoch ends with a dev evaluation; no checkpoints: on this clock, whose every reading
    # is 4 s on, a checkpoint's reads would count as training time
    run = ("trainer.progress_bar=true", "trainer.max_steps=12", "trainer.log_every=7", "trainer.checkpoint_every=0")
    with caplog.at_level(logging.INFO):
        run_tiny(tmp_path / "run", *run)
    said = [(r.name, r.getMessage()) for r in caplog.records]
    progress = [m for name, m in said if name == progress_module.__name__]
    assert any(m.startswith("dev evaluation: 32/60 pairs (53%), ") and RATE_LEFT.search(m) for m in progress)
    *train, last = [m for m in progress if m.startswith("train: ")]
    assert last.startswith("train: 12/12 steps (100%)") and "done in" in last
    steps = [int(re.match(r"train: (\d+)/12 steps \(\d+%\), ", m)[1]) for m in train]
    assert len(steps) >= 3 and 7 not in steps, train  # step 7's row is its line
    assert all(RATE_LEFT.search(m) for m in train) and all("loss=" in m for m in train if int(m[7:9].strip("/")) > 7)
    # the rate leaves the evaluations out (tqdm's unpause): ~12 s a step on this clock, an evaluation ~30 s more
    assert all(float(re.search(r", ([\d.]+) s/step", m)[1]) < 15 for m in train), train
    rows = [m for name, m in said if name == "lychee_exp.tracking.console" and re.match(r"step \d+/12 \|", m)]
    assert len(rows) == 2 and re.search(r"\| \d\d:\d\d left$", rows[0]) and not rows[1].endswith("left"), rows
