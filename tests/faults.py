"""Fault injection for the tests of failure handling:
LYCHEE_FAULT=<rank>:<step>:<raise|kill|kill_in_eval|hang|oom|wait|zero>[:<trial>[:<batch>]] makes that rank fail right
after that optimizer step (oom: as a CUDA out-of-memory error would; kill_in_eval: SIGKILL at the first forward of the
dev evaluation after it; wait is no failure: the rank waits until the path in LYCHEE_FAULT_WAIT_FOR exists, e.g. a
trial held until another worker's trial began, and raises after WAIT_S seconds without it; zero is no failure either:
the trainable weights become 0, and the model then scores every pair alike, exactly, on any machine: a dev figure
known in advance, the tie order's; name every rank for DDP). With a trial number (-1: any), only in that sweep trial
(the sweep's other trials run normally); with a batch, only while data.batch_size is at least that (so an OOM retry
with half the batch completes, as it would on a real GPU). Several faults, comma-separated, fire each in its own
rank/trial (one sweep then shows several failures); where two match, the first is the one.

The trainer asks `fault_hook` once at setup; without LYCHEE_FAULT (always, outside tests) it gets None and its
loop calls nothing."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

import torch

WAIT_S = 300


def fault_hook(rank: int, trial_number: int = -1, batch_size: int = 0) -> Callable[[int, torch.nn.Module], None] | None:
    """A per-step callback that fires this rank's injected fault, or None when no fault targets this rank."""
    for spec in filter(None, os.environ.get("LYCHEE_FAULT", "").split(",")):
        fault_rank, fault_step, action, *rest = spec.split(":")
        trial, min_batch = (int(rest[0]) if rest else -1), (int(rest[1]) if len(rest) > 1 else 0)
        if int(fault_rank) == rank and trial in (-1, trial_number) and batch_size >= min_batch:
            return _after_step(int(fault_step), action, rank)
    return None


def _after_step(fault_step: int, action: str, rank: int) -> Callable[[int, torch.nn.Module], None]:
    def after_step(step: int, model: torch.nn.Module) -> None:
        if step == fault_step:
            _fire(action, rank, step, model)

    return after_step


def _kill_in_eval(module: torch.nn.Module, args) -> None:
    if not module.training:
        print(f"LYCHEE_FAULT kill_in_eval fired at {time.time():.3f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _fire(action: str, rank: int, step: int, model: torch.nn.Module) -> None:
    # the moment the fault fires, so that tests time the job's reaction from here, not from its start-up
    print(f"LYCHEE_FAULT {action} fired at {time.time():.3f}", file=sys.stderr, flush=True)
    if action == "zero":
        with torch.no_grad():  # a sharded (fsdp) parameter zeroes its own shard
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.zero_()
        return
    if action == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "kill_in_eval":  # SIGKILL at the next forward in eval mode: in the evaluation after this step
        for module in model.modules():
            module.register_forward_pre_hook(_kill_in_eval)
    if action == "oom":
        raise torch.OutOfMemoryError(f"injected out of memory on rank {rank} at step {step}")
    if action == "hang":
        time.sleep(3600)
    if action == "wait":
        path, deadline = os.environ["LYCHEE_FAULT_WAIT_FOR"], time.monotonic() + WAIT_S
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} waited {WAIT_S} s after step {step} for {path}: it never appeared")
            time.sleep(0.2)
