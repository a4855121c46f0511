"""Fault injection for the tests of failure handling: LYCHEE_FAULT=<rank>:<step>:<raise|kill|hang|oom> makes that
rank fail right after that optimizer step (oom: as a CUDA out-of-memory error would). Unset (always, outside tests), it does nothing."""
from __future__ import annotations

import os
import signal
import sys
import time


def inject_fault(rank: int, step: int) -> None:
    fault = os.environ.get("LYCHEE_FAULT")
    if not fault:
        return
    fault_rank, fault_step, action = fault.split(":")
    if int(fault_rank) != rank or int(fault_step) != step:
        return
    # the moment the fault fires, so that tests time the job's reaction from here, not from its start-up
    print(f"LYCHEE_FAULT {action} fired at {time.time():.3f}", file=sys.stderr, flush=True)
    if action == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out of memory on rank {rank} at step {step}")
    if action == "hang":
        time.sleep(3600)
