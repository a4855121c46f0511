"""The peak resident memory of a launch's rank processes, watched from the launcher: a rank killed by SIGKILL (the
kernel's out-of-memory killer, most often) cannot report its own, so a thread reads each rank's high-water mark
(VmHWM: tracking.memory.peak_rss_mb) every POLL_S seconds while it lives, and the failure line names the last one
read. Growth in the rank's last POLL_S before the kill is not seen: the figure is a floor.

Elastic ranks (forked or spawned by torch's agent, whose pids the agent keeps to itself) write their pid into the
launch's notes directory as they start (`note_pid`); warm ranks are this process's own children."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Callable, Iterable

from lychee_exp.tracking.memory import peak_rss_mb

POLL_S = 0.5  # a read of /proc/<pid>/status per rank: ~0.1 ms
PID_NOTE = "pid"  # <notes>/pid<rank>@<host>: the rank's pid (notes of several nodes may share a file system)


def note_pid(notes: Path, rank: int) -> None:
    """A rank, as it starts: its pid, for its node's launcher's PeakWatch."""
    notes.mkdir(parents=True, exist_ok=True)
    (notes / f"{PID_NOTE}{rank}@{socket.gethostname()}").write_text(f"{os.getpid()}\n")


def noted_pids(notes: Path) -> list[int]:
    """The pids that this node's ranks noted."""
    pids = []
    for note in notes.glob(f"{PID_NOTE}*@{socket.gethostname()}"):
        try:
            pids.append(int(note.read_text()))
        except (OSError, ValueError):  # being written
            continue
    return pids


class PeakWatch:
    """A context in which a daemon thread keeps the peak resident memory (MB) of the processes `pids()` names."""

    def __init__(self, pids: Callable[[], Iterable[int]], poll_s: float = POLL_S):
        self.pids, self.poll_s = pids, poll_s
        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakWatch:  # entered again for each job of warm ranks: a new thread each time
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="lychee-rank-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.poll_s):
                return

    def poll(self) -> None:
        for pid in self.pids():
            peak = peak_rss_mb(pid)
            if peak is not None:  # None: gone (its last figure stays)
                self.peaks[pid] = max(peak, self.peaks.get(pid, 0.0))

    def peak_mb(self, pid: int | None) -> float | None:
        return None if pid is None else self.peaks.get(pid)
