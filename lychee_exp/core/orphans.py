"""Orphan protection for any process this package starts (ranks, sweep slots): it dies with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent_pid: int | None = None) -> None:
    """If the launching process is killed (SIGKILL, OOM killer), its ranks must not train on as orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # the parent died before prctl took effect (compared by pid: a parent may itself be pid 1, in a container)
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(1)
