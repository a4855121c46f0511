"""Small process facts shared by every way of starting ranks: orphan protection (from core.orphans), one-line
failure reasons, and a free local port for a rendezvous."""

from __future__ import annotations

import socket

from lychee_exp.core.orphans import die_with_parent

__all__ = ["die_with_parent", "free_port", "one_line"]  # die_with_parent: lychee_exp.core.orphans (sweep slots too)


def one_line(err: BaseException) -> str:
    """The exception's type and the first line of its message (CUDA errors add advice lines after the cause)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it; another process may take it later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
