"""Small process facts shared by every way of starting processes (ranks, sweep slots): orphan protection, one-line
failure reasons, and a free local port for a rendezvous."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys


def one_line(err: BaseException) -> str:
    """The exception's type and the first line of its message (CUDA errors add advice lines after the cause)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it; another process may take it later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent(parent_pid: int | None = None) -> None:
    """If the launching process is killed (SIGKILL, OOM killer), its ranks must not train on as orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # the parent died before prctl took effect (compared by pid: a parent may itself be pid 1, in a container)
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(1)
