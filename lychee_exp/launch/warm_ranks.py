"""Warm ranks: DDP ranks that outlive one job, so that a sweep worker starts processes, imports torch and
transformers and forms the process group once, not once per trial.

They live in the sweep worker's process (the Hydra process, whose basic launcher runs each trial in place) as
spawned children, each in a loop: wait for a job, run it, send back its result. Everything a trial owns
(model, optimizer, data order, seeds, logger, log files) the job builds inside the rank; what survives a trial
is the process, its imports, its process group and its read-only caches. A failed job (an exception, an OOM,
a rank that died or hung) ends all the ranks, and the next job starts fresh ones: no trial inherits a
half-broken process group or a fragmented CUDA heap.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from lychee_exp.launch.failures import killed_by_signal
from lychee_exp.launch.processes import die_with_parent, free_port, one_line
from lychee_exp.launch.rank_memory import PeakWatch

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 1.0  # after the first failure, how long the other ranks may still report why they failed
CLOSE_TIMEOUT_S = 10.0
# how long spawning the ranks (imports included) and forming their process group may take; a rendezvous that
# never completes (e.g. a port taken by another job between free_port and the bind) would otherwise wait for the
# whole collective timeout (parallel.timeout_s, 30 min by default) before anyone hears of it
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankSetup:
    """What ranks are started with; a job that needs another setup gets new ranks."""

    world_size: int
    device_type: str  # cuda | cpu
    threads: int  # torch intra-op threads per CPU rank
    backend: str  # auto | nccl | gloo
    timeout_s: int  # collective timeout
    # the environment the ranks start with (NCCL_*, PYTORCH_CUDA_ALLOC_CONF, OMP_* act at start-up only), less
    # what a job hands over itself
    environ: tuple[tuple[str, str], ...] = ()


class RanksFailed(Exception):
    """One or more ranks failed (or died) during a job: {rank: (unix time, one-line reason)}."""

    def __init__(self, failures: dict[int, tuple[float, str]]):
        super().__init__("; ".join(f"rank {rank}: {why}" for rank, (_, why) in sorted(failures.items())))
        self.failures = failures


def _rank_loop(
    rank: int, setup: RankSetup, port: int, parent_pid: int, conn: Connection, init: Callable, job: Callable
) -> None:
    """A rank's whole life: form the process group (init), then run jobs until told to stop or one fails."""
    die_with_parent(parent_pid)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(setup.world_size),
        LOCAL_WORLD_SIZE=str(setup.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        state = init(setup)
    except BaseException as err:  # noqa: B036 (the parent must hear of any failure, then this process ends)
        conn.send(("failed", time.time(), one_line(err)))
        return
    conn.send(("ready",))
    while True:
        try:
            request = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if request is None:  # the sweep is over
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            return
        try:
            result = job(state, *request)
        except BaseException as err:  # noqa: B036
            conn.send(("failed", time.time(), one_line(err)))
            return  # the parent ends every rank after a failure: collectives with this group are not safe
        conn.send(("done", result))


class WarmRanks:
    """`setup.world_size` spawned ranks that run `job(state, *args)` on request; `state = init(setup)` once."""

    def __init__(self, setup: RankSetup, init: Callable, job: Callable):
        self.setup, self.init, self.job = setup, init, job
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.jobs_run = 0
        self._watch = PeakWatch(lambda: [process.pid for process in self.processes])

    @property
    def alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def start(self) -> None:
        """Spawns the ranks and waits until their process group is formed; RanksFailed if it could not be."""
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.setup.world_size):
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(
                target=_rank_loop,
                args=(rank, self.setup, port, os.getpid(), child_end, self.init, self.job),
                name=f"lychee-rank{rank}",
                # not daemonic: a daemon may not start children, and DataLoader workers are children. The ranks
                # end with the sweep worker anyway: close_warm_ranks at exit, PR_SET_PDEATHSIG if it is killed.
                daemon=False,
            )
            process.start()
            child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)
        replies = self._collect(start_timeout=START_TIMEOUT_S)
        failed = {rank: (reply[1], reply[2]) for rank, reply in replies.items() if reply[0] == "failed"}
        if failed:
            raise RanksFailed(failed)

    def run(self, *args: Any) -> list[Any]:
        """Runs one job on every rank; returns each rank's result. On any failure every rank is ended (the next
        job needs new ranks) and RanksFailed names what each failing rank reported."""
        try:
            for conn in self.conns:
                conn.send(args)
            with self._watch:  # the ranks' peak memory, for a rank killed by a signal
                replies = self._collect()
        except BaseException:  # Ctrl-C, or a rank gone before it got the job: no rank may train on
            self.close(kill=True)
            raise
        self.jobs_run += 1
        return [replies[rank][1] for rank in range(len(self.conns))]

    def _collect(self, start_timeout: float | None = None) -> dict[int, tuple]:
        """One reply per rank. A rank that fails or dies fails the whole job: the others get FAILURE_GRACE_S to
        report their own reason (the first one may be a consequence of another rank's failure), then all end.
        With a start_timeout (seconds), ranks silent by then fail as not started."""
        replies: dict[int, tuple] = {}
        failures: dict[int, tuple[float, str]] = {}
        start_deadline = None if start_timeout is None else time.monotonic() + start_timeout
        deadline = start_deadline
        pending = set(range(len(self.conns)))
        while pending:
            handles = {**{self.conns[r]: r for r in pending}, **{self.processes[r].sentinel: r for r in pending}}
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(handles), timeout)
            if not ready:
                if not failures:  # the start deadline passed with no rank failing: every silent rank is stuck
                    failures = {r: (time.time(), f"not ready after {start_timeout:.0f} s") for r in pending}
                break  # the grace period is over: the silent ranks are stuck in a collective with a dead peer
            for rank in sorted({handles[h] for h in ready}):
                reply = self._receive(rank)
                pending.discard(rank)
                if reply[0] == "failed":
                    failures[rank] = (reply[1], reply[2])
                else:
                    replies[rank] = reply
            if failures and deadline == start_deadline:
                deadline = time.monotonic() + FAILURE_GRACE_S
        if failures:
            self.close(kill=True)
            raise RanksFailed(failures)
        return replies

    def _receive(self, rank: int) -> tuple:
        conn, process = self.conns[rank], self.processes[rank]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        process.join(timeout=1.0)
        code = process.exitcode
        if code is None:
            why = "closed its pipe without a reply"
        elif code < 0:  # "killed by SIGKILL (signal 9), most likely ..."
            return ("failed", time.time(), killed_by_signal(-code, process.pid, self._watch.peak_mb(process.pid)))
        else:
            why = f"exited with code {code}"
        return ("failed", time.time(), f"the process {why}")

    def close(self, kill: bool = False) -> None:
        """Stops the ranks: asked to leave (they destroy their process group), or killed (after a failure)."""
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(None)
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=CLOSE_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []


_warm: WarmRanks | None = None


def warm_ranks(setup: RankSetup, init: Callable, job: Callable) -> tuple[WarmRanks, bool]:
    """This process's ranks for `setup`: the ones kept from the last job if they fit (reused=True), else new."""
    global _warm
    if _warm is not None and _warm.setup == setup and _warm.init is init and _warm.job is job and _warm.alive:
        return _warm, True
    close_warm_ranks()
    for attempt in range(2):  # the free port may be taken before rank 0 binds it: one more try, on another
        ranks = WarmRanks(setup, init, job)
        try:
            ranks.start()
            break
        except RanksFailed as err:
            ranks.close(kill=True)
            if attempt:
                raise
            log.warning("warm ranks did not start (%s): trying once more", err)
        except BaseException:
            ranks.close(kill=True)
            raise
    _warm = ranks
    return ranks, False


@atexit.register
def close_warm_ranks() -> None:
    global _warm
    if _warm is not None:
        _warm.close()
        _warm = None
