"""A rank killed by a signal is named with the signal and, for SIGKILL, the likely cause and the peak memory the
launcher watched it reach (the rank itself cannot say: launch.rank_memory). The whole flow, a DDP rank SIGKILLed
mid-run, is tests/test_ddp.py::test_killed_rank_ends_the_job_quickly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from lychee_exp.launch import failures
from lychee_exp.launch.failures import killed_by_signal, rank_failure
from lychee_exp.launch.rank_memory import PeakWatch


def test_a_signal_other_than_sigkill_is_named_alone():
    assert killed_by_signal(signal.SIGTERM, 123, 500.0) == "killed by SIGTERM (signal 15)"
    assert rank_failure(2, "killed by SIGTERM (signal 15)") == "rank 2 was killed by SIGTERM (signal 15)"
    assert rank_failure(2, "ValueError: x") == "rank 2 failed: ValueError: x"


def test_sigkill_names_the_cause_and_the_peak(monkeypatch):
    monkeypatch.setattr(failures, "_oom_kill_line", lambda pid: None)  # dmesg without a line on it
    said = killed_by_signal(signal.SIGKILL, 123, 3942.0)
    assert said.startswith(
        "killed by SIGKILL (signal 9), most likely by the kernel's out-of-memory killer: it peaked at 3.85 GB resident"
    ), said
    assert "dmesg | grep -i 'killed process'" in said
    kernel = "Out of memory: Killed process 123 (python) total-vm:9000000kB, anon-rss:3900000kB"
    monkeypatch.setattr(failures, "_oom_kill_line", lambda pid: kernel)
    said = killed_by_signal(signal.SIGKILL, 123, None)
    assert "SIGKILL (signal 9), by the kernel's out-of-memory killer: its peak memory was not seen" in said
    assert said.endswith(f"dmesg says: {kernel}")


def test_the_watch_keeps_the_peak_of_a_process_killed_by_sigkill():
    """A child that grows to ~300 MB, falls back, then is SIGKILLed: the watch keeps its high-water mark."""
    grow = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; import time; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", grow])
    with PeakWatch(lambda: [child.pid], poll_s=0.05) as watch:
        deadline = time.monotonic() + 30
        while (watch.peak_mb(child.pid) or 0) < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        time.sleep(0.2)  # polls after its death keep the last figure
    assert 300 <= watch.peak_mb(child.pid) < 400
