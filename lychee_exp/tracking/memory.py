"""A process's resident memory: its peak so far (the kernel's high-water mark) and its current size, in MB, for the
run's per-phase figures and for naming what a rank killed by a signal had used."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import resource
import sys
from pathlib import Path


def _status_kb(pid: int | str, field: str) -> int | None:
    """A /proc/<pid>/status field in kB (Linux); None where there is no such process or file."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return None


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """The process's peak resident set size (VmHWM) in MB; for this process also off Linux (getrusage: kB on
    Linux, bytes on macOS). None for another process that has gone or that /proc does not show."""
    kb = _status_kb(pid, "VmHWM")
    if kb is None and pid == "self":
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kb = maxrss // 1024 if sys.platform == "darwin" else maxrss
    return None if kb is None else kb / 1024


def rss_mb(pid: int | str = "self") -> float | None:
    """The process's resident set size now (VmRSS) in MB; None where /proc does not show it."""
    kb = _status_kb(pid, "VmRSS")
    return None if kb is None else kb / 1024


def machine_memory_mb() -> tuple[float, float]:
    """The machine's memory in MB: its total, and what is available now (psutil: MemAvailable on Linux)."""
    import psutil

    memory = psutil.virtual_memory()
    return memory.total / 2**20, memory.available / 2**20


def reset_peak_rss() -> None:
    """Starts a new peak for this process: Linux resets VmHWM to the current resident set when "5" is written to
    /proc/self/clear_refs; elsewhere (or where that is refused) the peak stays the process's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def release_freed_memory() -> None:
    """Hands memory that this process has freed back to the system: a garbage collection, then glibc's
    malloc_trim, which returns the free pages its heaps keep for reuse (after the dense teacher, 0.12 GB of the Hydra
    process's 0.54 GB). Nothing elsewhere (another C library, macOS, Windows)."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
