"""What the pool tests of test_warm_ranks run on their spawned ranks. A spawned rank imports the module that
defines its functions: here that is torch alone, not the test module (optuna, the CLI's config, transformers),
so that each of the pool tests' rank starts costs seconds less."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def form_group(setup) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=setup.timeout_s))
    return dist.get_rank()


def summed(rank: int, value: float, fault: str = "", fault_rank: int = 1) -> dict:
    """All-reduces value over the ranks; `fault` makes fault_rank raise, die or hang first."""
    if rank == fault_rank and fault == "raise":
        raise ValueError(f"bad value on rank {rank}")
    if rank == fault_rank and fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == fault_rank and fault == "hang":
        time.sleep(3600)
    total = torch.tensor([value])
    dist.all_reduce(total)
    return {"rank": rank, "pid": os.getpid(), "sum": total.item()}


def never_forms(setup) -> None:
    raise RuntimeError("no network here")


def stuck_forming(setup) -> None:
    time.sleep(3600)  # a rendezvous that never completes, and never fails
