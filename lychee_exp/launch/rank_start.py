"""How the elastic agent starts a run's ranks, and what a rank takes from the process that launched it.

CUDA ranks are spawned: each is a fresh interpreter, so no CUDA state can be inherited. CPU ranks are forked from
a forkserver that imported the rank modules (torch, transformers, the recipe) once: a process that launches run
after run (a notebook, a benchmark, the test suite) pays those imports (about 3 s a rank here) once instead of
at every launch. A forkserver, unlike its launcher, keeps the environment and working directory of its own
start, possibly several launches ago, so a rank first takes the launcher's as they were at its launch
(`RankParent.adopt`), keeping what the agent set for it (RANK, MASTER_PORT, ...).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing import forkserver

from lychee_exp.launch.preemption import PREEMPT_SIGNAL
from lychee_exp.launch.processes import die_with_parent

# what every CPU rank imports: the forkserver imports them once (lychee_exp.launch.ranks: training; scoring: rerank)
RANK_MODULES = ["lychee_exp.launch.ranks", "lychee_exp.launch.scoring"]
_server: tuple[int, dict[str, str]] | None = None  # the forkserver's pid and the environment it started with


@dataclass(frozen=True)
class RankParent:
    """What a rank needs of its launcher: its parent's pid (orphan protection) and, forked from the forkserver,
    the launcher's pid, environment and working directory at the launch."""

    pid: int | None
    environ: dict[str, str] | None = None
    server_environ: dict[str, str] | None = None
    cwd: str | None = None
    launcher_pid: int | None = None

    def adopt(self) -> None:
        die_with_parent(self.pid)
        if self.environ is None:
            return
        # the forkserver, this rank's parent, outlives a killed launcher while its ranks run: watch the launcher
        threading.Thread(target=_exit_when_gone, args=(self.launcher_pid,), name="launcher-watch", daemon=True).start()
        # what differs from the forkserver's own start is what the agent set for this rank
        agent = {k: v for k, v in os.environ.items() if self.server_environ.get(k) != v}
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(agent)
        os.chdir(self.cwd)


def _exit_when_gone(pid: int) -> None:
    """Ends this process (SIGKILL, as PR_SET_PDEATHSIG would) once process `pid` has ended."""
    try:
        handle = os.pidfd_open(pid)  # Linux 5.3+: readable once the process ends
    except ProcessLookupError:
        handle = None  # ended already
    except (AttributeError, OSError):  # no pidfd: poll
        while _alive(pid):
            time.sleep(1.0)
        handle = None
    if handle is not None:
        select.select([handle], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def _helpers_ignore(*signums: int) -> Iterator[None]:
    """Processes started inside ignore these signals from their start (an ignored signal stays ignored across fork
    and exec). SLURM signals every process of a job step: the forkserver and multiprocessing's resource tracker,
    whose default action for USR2 is to end, would die of a preemption notice (and with the forkserver its ranks,
    which die with their parent); the ranks install their own handler. Ctrl-C reaches the terminal's whole process
    group: a forkserver still starting its interpreter would die of it with a "Fatal Python error" dump; ignoring it
    there is safe, since the launcher stops the ranks and the forkserver's own import of lychee_exp installs the
    ranks' quiet handler. This process's handlers are back at once (the server starts in milliseconds; it does not
    wait for the preloads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_server() -> None:
    """Ctrl-C or a stop signal ended a launch: this process's forkserver goes at once. It would see its launcher
    gone only back in its own loop, seconds later if it was still importing (it ignores Ctrl-C while it starts);
    the next launch starts a new one."""
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def rank_start(device_type: str) -> tuple[str, RankParent]:
    """The start method for a launch's ranks and what they take from this process."""
    server = getattr(forkserver, "_forkserver", None)
    if device_type != "cpu" or server is None or not hasattr(server, "_forkserver_pid"):
        return "spawn", RankParent(os.getpid())
    multiprocessing.set_forkserver_preload(RANK_MODULES)
    # the forkserver never outlives this process: a Ctrl-C that ends the command while the forkserver still imports
    # (it ignores Ctrl-C then, also while ensure_running starts it) would leave it running until its imports finish
    atexit.unregister(stop_server)  # once, however many launches
    atexit.register(stop_server)
    with _helpers_ignore(PREEMPT_SIGNAL, signal.SIGINT):
        server.ensure_running()  # (re)starts it if it is not running, with this process's environment as it is now
    global _server
    if _server is None or _server[0] != server._forkserver_pid:  # started just now
        _server = (server._forkserver_pid, dict(os.environ))
    pid, server_environ = _server
    return "forkserver", RankParent(pid, dict(os.environ), server_environ, os.getcwd(), os.getpid())
