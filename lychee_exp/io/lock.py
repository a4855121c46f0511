"""The lock of one output (a command's out=, a training run's directory): an OS lock (flock) on a short hidden
file beside it, held by the one process that writes the output, and removed when that process lets go.

The lock file's name is the output's name cut short plus a hash of its whole path, so that any name a file system
takes still gives a lock name it takes (NAME_MAX is 255 bytes), and two outputs never share one. Removing the file
at release is safe because a process that locked a file that was removed meanwhile sees it (the path no longer
leads to the file it holds) and tries again; so no `.lock` files pile up beside outputs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import time
from pathlib import Path
from typing import Callable

from lychee_exp.errors import UserError

SHORT_NAME = 40  # characters of the output's name kept in its lock's and staging directories' names


def short_name(target: Path) -> str:
    """The output's name as hidden companions (lock, staging) spell it: short, and unique to its whole path."""
    digest = hashlib.sha1(str(target).encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return f"{target.name[:SHORT_NAME]}.{digest}"


def lock_path(target: Path) -> Path:
    """The lock file of an output (present while a command writes it)."""
    return target.parent / f".{short_name(target)}.lock"


class OutputLock:
    """Held by the process that writes `target`; a second process is refused at once, in one line, or, with
    `wait_s`, waits that long for it (a table several processes update in turn) before it is refused.
    `waiting(holder)` is told once when a wait begins ("pid <pid> on <host>", or "" when unknown)."""

    def __init__(self, target: Path, what: str, wait_s: float = 0.0, waiting: Callable[[str], None] | None = None):
        self.target, self.what, self.path, self.wait_s = target, what, lock_path(target), wait_s
        self.waiting = waiting
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        deadline = time.monotonic() + self.wait_s
        told = False
        while True:
            try:
                return self._try_acquire()
            except _Busy as busy:
                if time.monotonic() >= deadline:
                    raise UserError(str(busy)) from None
                if self.waiting is not None and not told:
                    self.waiting(busy.holder)
                    told = True
                time.sleep(0.05)

    def _try_acquire(self) -> OutputLock:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as err:
                raise UserError(f"{self.what}: cannot create its lock {self.path} ({err.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read_holder(fd)
                os.close(fd)
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise UserError(f"{self.what}: cannot lock {self.path} ({err.strerror})") from None
                held = f" ({holder})" if holder else ""
                waited = f" (waited {self.wait_s:.0f} s)" if self.wait_s else ""
                raise _Busy(
                    f"{self.what} is in use by another command{held}{waited}: wait for it, or write elsewhere", holder
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed it between our open and our lock: lock the new one
        try:  # who holds it, for a second command's one line; a full disk only costs that line its holder
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # before unlocking: a waiter then finds the new file, not this one (a directory made read-only meanwhile
        # keeps the lock file, harmless)
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class _Busy(Exception):
    """Another process holds the lock (its one line, and who holds it)."""

    def __init__(self, line: str, holder: str):
        super().__init__(line)
        self.holder = holder


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> str:
    try:
        pid, _, host = os.pread(fd, 200, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        return ""
    return f"pid {pid} on {host}" if pid.isdigit() else ""
