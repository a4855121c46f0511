"""Stopping a run early on request: checkpoint at the next step, stop, and let the scheduler requeue it.

SLURM (through submitit) sends USR2 (SUBMITIT_PREEMPT_SIGNAL) some time before a job's limit or when it is
preempted. Whoever receives it (the job's main process, and on some clusters the ranks too) leaves a request
file in the run directory; after every optimizer step rank 0 looks for it and one all-reduce shares the answer,
so all ranks write one collective checkpoint after the same step and stop. The main process then hands the
signal to the handler it replaced: submitit's, which calls the launcher's `checkpoint()` (the same run
directory and trainer.resume=auto: hydra_plugins/lychee_submitit_launcher) and requeues the job. Without
submitit the run ends with a one-line `Preempted` error; the same command with trainer.resume=auto continues it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lychee_exp.errors import Preempted

log = logging.getLogger(__name__)

PREEMPT_SIGNAL = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), signal.SIGUSR2)
REQUEST_FILE = "logs/stop_requested"


def request_stop(output_dir: Path) -> None:
    path = Path(output_dir) / REQUEST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{time.time():.3f} pid {os.getpid()}\n")


def install_rank_handler(output_dir: Path) -> None:
    """In a rank: the signal's default action would kill it; turn it into a stop request instead."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(PREEMPT_SIGNAL, lambda signum, frame: request_stop(output_dir))


def stop_requested(output_dir: Path, env) -> bool:
    """Collective: whether the run was asked to stop (the same answer on every rank)."""
    asked = env.is_main and (Path(output_dir) / REQUEST_FILE).exists()
    if env.distributed:
        flag = torch.tensor([int(asked)], device=env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        asked = bool(flag.item())
    return asked


class PreemptionWatch:
    """Held by the job's main process while its ranks train."""

    def __init__(self, output_dir: Path):
        self.output_dir = Path(output_dir)
        self.previous = None
        self.signum: int | None = None

    def __enter__(self) -> PreemptionWatch:
        (self.output_dir / REQUEST_FILE).unlink(missing_ok=True)  # a request of an earlier attempt is done
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(PREEMPT_SIGNAL, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        self.signum = signum
        request_stop(self.output_dir)
        log.warning("%s received: the ranks checkpoint after this step and stop", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(PREEMPT_SIGNAL, self.previous)

    def hand_over(self, step: int) -> None:
        """After the ranks checkpointed at `step` and stopped: the replaced handler (submitit's requeue, which
        exits) runs now; otherwise the run ends with Preempted."""
        (self.output_dir / REQUEST_FILE).unlink(missing_ok=True)
        if callable(self.previous) and self.signum is not None:
            log.info(
                "checkpoint at step %d written: handing %s to the job's handler (submitit requeues the job)",
                step,
                signal.Signals(self.signum).name,
            )
            self.previous(self.signum, None)
        raise Preempted(
            f"stopped on request after step {step}, checkpoint in {self.output_dir / 'checkpoints'}; "
            "the same command with trainer.resume=auto continues the run",
            "preempted",
        )
