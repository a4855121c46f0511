"""Peak resident memory (RSS) per phase of a run, in each process that runs one: the Hydra process's data steps
(mining, the dense teacher's scoring of the dev candidates), and each rank's load (inputs, model, optimizer),
training and evaluation. A phase's peak is the kernel's high-water mark (VmHWM) reset as the phase starts and read
as it ends, so each phase shows its own peak rather than the process's so far; a phase entered inside another
(an evaluation during training) is counted apart, and the outer phase's peak is its own segments' highest.

Off Linux, or where /proc/self/clear_refs cannot be written, the mark is not reset: a phase's figure is then the
process's peak up to the phase's end (never less than the phase's own). RSS counts shared pages too (the libraries
and, in a rank forked from the forkserver, the pages it still shares with it): a rank's figure is what it holds
mapped, not what it alone adds to the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

from lychee_exp.tracking.memory import peak_rss_mb, reset_peak_rss

# phase names, as metrics.json keys spell them, and as the summary line says them
# the Hydra process: the data steps, then the checks' read of the inputs (tokenizer, data), then the launch
HYDRA_PHASES = {
    "mining": "mining",
    "dense_teacher": "dense teacher",
    "checks": "checks",
    "ranks": "while the ranks ran",
}
RANK_PHASES = {"load": "load", "training": "training", "evaluation": "evaluation"}
RANK_KEY = "peak_rss_mb_{}"  # the busiest rank's peak in a phase; `<key>_per_rank` lists each rank's
HYDRA_KEY = "hydra_peak_rss_mb_{}"  # the Hydra process's peak in one of its phases
# the Hydra process's phase peaks, handed to the ranks it starts so that rank 0's logger summary holds them too
HANDED_ENV = "LYCHEE_HYDRA_PEAK_RSS_MB"


class PhasePeaks:
    """This process's peak RSS per phase in MB; `phase(name)` measures one (phases can nest)."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self._open: list[str] = []

    def clear(self) -> None:
        """A new job in this process (a warm rank's next trial): its own phases only."""
        self.peaks.clear()
        self._open.clear()
        reset_peak_rss()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._open:
            self._record(self._open[-1])  # the outer phase's segment so far
        reset_peak_rss()
        self._open.append(name)
        try:
            yield
        finally:
            self._open.pop()
            self._record(name)
            reset_peak_rss()  # the outer phase's next segment starts here

    def snapshot(self) -> dict[str, float]:
        """The peaks so far, the open phases' current segments included."""
        for name in self._open:
            self._record(name)
        return dict(self.peaks)

    def _record(self, name: str) -> None:
        peak = peak_rss_mb()
        if peak is not None:
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)


PEAKS = PhasePeaks()  # one per process: a process runs one job's phases at a time
phase = PEAKS.phase


def rank_figures(per_rank: list[dict[str, float]]) -> dict:
    """metrics.json's keys from every rank's phase peaks (rank order): each phase's list and its highest."""
    figures: dict = {}
    for name in RANK_PHASES:
        values = [peaks.get(name) for peaks in per_rank]
        if any(value is not None for value in values):
            figures[RANK_KEY.format(name) + "_per_rank"] = values
            figures[RANK_KEY.format(name)] = max(v for v in values if v is not None)
    return figures


def hydra_figures(peaks: dict[str, float]) -> dict:
    return {HYDRA_KEY.format(name): peaks[name] for name in HYDRA_PHASES if name in peaks}


def hand_down(peaks: dict[str, float]) -> None:
    """The Hydra process's phase peaks into the environment its ranks start with (handed_down reads them there)."""
    os.environ[HANDED_ENV] = json.dumps(hydra_figures(peaks))


def handed_down() -> dict:
    try:
        return {str(k): float(v) for k, v in json.loads(os.environ.get(HANDED_ENV, "{}")).items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def summary_line(metrics: dict) -> str | None:
    """`peak RSS: load 0.61 GB, training 0.90 GB, evaluation 1.40 GB (busiest of 2 ranks); Hydra process: mining
    0.75 GB, dense teacher 0.80 GB, ...`, or None for a run without the figures (written before they existed)."""

    def gb(mb: float) -> str:
        return f"{mb / 1024:.2f} GB"

    def said(phases: dict[str, str], key: str) -> list[str]:
        return [f"{label} {gb(metrics[key.format(n)])}" for n, label in phases.items() if key.format(n) in metrics]

    ranks, hydra = said(RANK_PHASES, RANK_KEY), said(HYDRA_PHASES, HYDRA_KEY)
    if not ranks and not hydra:
        return None
    line = "peak RSS: " + ", ".join(ranks)
    count = len(metrics.get(RANK_KEY.format("training") + "_per_rank") or [])
    if ranks and count > 1:
        line += f" (the busiest of {count} ranks)"
    if hydra:
        line += ("; " if ranks else "") + "Hydra process: " + ", ".join(hydra)
    return line
