"""A long phase's progress (mining, dense encoding, evaluation, rerank's scoring, training): tqdm's bar where stderr
is a terminal, and where it is not (nohup, Slurm, CI, a pipe) a line through logging, so that it lands in the job's
log and Slurm's output with a timestamp:

    rerank test: 1,200/5,600 pairs (21%), 38.2 pairs/s, 01:55 left, 00:31 elapsed

A line comes once a tenth of the phase is done or LINE_EVERY_S have passed since the last one, whichever is first,
but never sooner than MIN_GAP_S after it: a 6-minute phase says where it is every 30 s, a 1-minute one every 10 s,
one of a few seconds nothing. The rate is the one since the last line (scoring batches come longest first, so the
rate since the start would overstate what is left); tqdm computes the percentage and the time left, and formats
the clock. A phase that printed a line ends with one (its whole count, mean rate and time).

Lines go to the `lychee_exp.io.progress` logger at INFO (a rank other than 0 logs warnings only), whose handlers
are the job's: its run.log and stderr; a DDP rank 0's stderr is teed to the console. `progress_bar=false` (a command's
key, `trainer.progress_bar` in a run) turns off both the bar and the lines; an entry point hands its value to code
that has no config (dense encoding) with `progress_shown`. May import: nothing of lychee_exp."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from typing import Iterable, Iterator

from tqdm import tqdm

LINE_EVERY_S = 30.0  # the longest silence between two lines of a running phase
MIN_GAP_S = 10.0  # the shortest gap between two lines: a fast phase's tenths come sooner
PARTS = 10  # a line every tenth of the phase (when the tenth comes before LINE_EVERY_S)

log = logging.getLogger(__name__)
_SHOWN = contextvars.ContextVar("lychee_progress_shown", default=True)


@contextlib.contextmanager
def progress_shown(shown: bool) -> Iterator[None]:
    """Within: progress is shown only where `shown` (a command's progress_bar, and whether this is the main rank),
    even by code handed no config (dense encoding)."""
    token = _SHOWN.set(shown)
    try:
        yield
    finally:
        _SHOWN.reset(token)


def progress_meter(
    iterable: Iterable | None = None,
    *,
    desc: str,
    unit: str,
    units: str | None = None,
    total: int | None = None,
    shown: bool = True,
    rows_every: int = 0,
    **tqdm_args,
) -> tqdm:
    """A tqdm over `iterable` (or updated by hand up to `total`): the bar on a terminal, else LogLines. Shown where
    `shown` (e.g. the main rank) and no enclosing progress_shown(False) says otherwise; else a disabled tqdm.
    `unit` counts one item in the bar ("pair"), `units` many in a line (default: unit + "s"). `rows_every`: the
    caller logs a row of its own at every multiple of that count (training's step rows, with row_eta): no line
    there."""
    disable = not (shown and _SHOWN.get())
    if _terminal() or disable:
        return tqdm(iterable, desc=desc, unit=unit, total=total, disable=disable, **tqdm_args)
    for terminal_only in ("dynamic_ncols", "leave", "position", "ncols", "file"):
        tqdm_args.pop(terminal_only, None)
    units = units or f"{unit}s"
    return LogLines(iterable, desc=desc, unit=unit, units=units, total=total, rows_every=rows_every, **tqdm_args)


def _terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)  # None: no stderr at all (pythonw)
    return bool(isatty and isatty())


def row_eta(bar: tqdm) -> str:
    """For a caller that logs its own rows of the phase (training's step rows): the time left as the lines would
    say it (' | 01:55 left'), and the row counts as a line, so that no line repeats it soon after. '' where no
    lines are written (a bar on a terminal shows it; off, nothing is shown) and at the phase's end."""
    if not isinstance(bar, LogLines) or bar.disable or (bar.total and bar.n >= bar.total):
        return ""
    left = bar.text(bar._time(), "{remaining}")
    bar.line_said()
    return f" | {left} left"


class LogLines(tqdm):
    """tqdm without a bar: a logged line at the pace the module's doc says. tqdm counts, times, works out the
    percentage and the time left and formats them (format_meter); this class decides when a line is due
    (display, which tqdm calls at every update) and logs it."""

    monitor_interval = 0  # no monitor thread: every update asks display whether a line is due
    LINE = "{desc}: {count} ({percentage:.0f}%), {speed}, {remaining} left, {elapsed} elapsed{postfix}"
    LAST = "{desc}: {count} ({percentage:.0f}%), {speed}, {ended} {elapsed}{postfix}"
    UNCOUNTED = "{desc}: {count}, {speed}, {elapsed} elapsed{postfix}"  # no total: no percentage, nothing left

    def __init__(self, iterable=None, *, units: str, rows_every: int = 0, **tqdm_args):
        self.units, self.rows_every = units, rows_every
        # every update reaches display; the file takes what tqdm would write besides (close's newline)
        super().__init__(iterable, mininterval=0, miniters=1, file=_Discard(), ascii=True, leave=True, **tqdm_args)
        self._line_t, self._line_n, self._lines = self.start_t, self.n, 0

    def display(self, msg=None, pos=None) -> bool:
        if msg is not None or not hasattr(self, "start_t"):  # a clear, or tqdm's first refresh in __init__
            return False
        now = self._time()
        if self.disable:  # close(): the phase's last line, where it logged any (not from tqdm's __del__ at exit)
            if self._lines and not sys.is_finalizing():
                log.info("%s", self.text(now, self.LAST if self.total else self.UNCOUNTED, last=True))
            return True
        since, done = now - self._line_t, self.n - self._line_n
        tenth = self.total / PARTS if self.total else float("inf")
        ending = self.total and self.n >= self.total  # the last line is close's
        row = self.rows_every and self.n % self.rows_every == 0  # the caller's row says it (row_eta)
        if done > 0 and not ending and not row and since >= MIN_GAP_S and (since >= LINE_EVERY_S or done >= tenth):
            log.info("%s", self.text(now, self.LINE if self.total else self.UNCOUNTED))
            self.line_said(now)
        return True

    def unpause(self) -> None:
        """tqdm's: the time since the last update was a pause (training's evaluations), left out of the rate and
        the time left, since the last line too."""
        if not self.disable:
            paused = self._time() - self.last_print_t
            super().unpause()
            self._line_t += paused

    def line_said(self, now: float | None = None) -> None:
        """A line about this phase was logged (by display, or by the caller: row_eta); the next is due from here."""
        self._line_t, self._line_n = self._time() if now is None else now, self.n
        self._lines += 1

    def text(self, now: float, bar_format: str, last: bool = False) -> str:
        """The phase at `now` in bar_format (tqdm's fields and count, speed, ended), at the rate since the last line;
        the phase's mean rate where that line is under MIN_GAP_S old (a caller's row right after it) or `last`."""
        elapsed, since = now - self.start_t, now - self._line_t
        whole = last or since < MIN_GAP_S
        done, seconds = (self.n - self.initial, elapsed) if whole else (self.n - self._line_n, since)
        rate = done / seconds if seconds > 0 else 0.0
        total = max(self.total, self.n) if self.total else None  # rank 0 counts its share times the ranks
        count = f"{self.n:,}/{total:,} {self.units}" if total else f"{self.n:,} {self.units}"
        speed = f"{rate:,.1f} {self.units}/s" if rate >= 1 or not rate else f"{1 / rate:,.1f} s/{self.unit}"
        ended = "done in" if total and self.n >= total else "stopped after"
        figures = {**self.format_dict, "total": total, "elapsed": elapsed, "rate": rate or None}
        figures.update(bar_format=bar_format, count=count, speed=speed, ended=ended)
        return self.format_meter(**figures)


class _Discard:
    """The file LogLines hands tqdm: what tqdm would write to a terminal goes nowhere (the lines are logged)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
