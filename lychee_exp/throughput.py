"""Training throughput and the numbers behind the multi-GPU guide's three questions:
out of memory (peak memory per rank), no speedup (share of step time waiting for data), uneven GPU use
(slowest / fastest rank)."""
from __future__ import annotations

import logging
import resource

import torch

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # the first steps pay for allocator and kernel warm-up; throughput skips them
DATA_WAIT_HINT = 0.2  # share of step time spent waiting for batches that earns a hint
RANK_SPREAD_HINT = 1.25  # slowest / fastest rank compute time that earns a hint


class StepTimer:
    """Sums step times after warm-up. `busy` is a rank's time outside collectives (data wait + forward):
    backward and the optimizer step wait for the slowest rank, so they would hide which rank is slow."""

    def __init__(self, first_step: int, total_steps: int):
        # a run too short to skip warm-up is timed whole rather than not at all
        self.timed_from = first_step + WARMUP_STEPS if total_steps - first_step > WARMUP_STEPS else first_step
        self.sums = {"time": 0.0, "wait": 0.0, "busy": 0.0, "queries": 0.0, "tokens": 0.0, "padded": 0.0}

    def add(self, step: int, elapsed: float, wait: float, busy: float, queries: float, tokens: float,
            padded: float) -> None:
        """`tokens`: real (non-pad) tokens; `padded`: batch slots, pad included."""
        if step > self.timed_from:
            for key, value in zip(self.sums, (elapsed, wait, busy, queries, tokens, padded)):
                self.sums[key] += value

    def rank_record(self, device: torch.device) -> dict:
        return {**self.sums, "peak_memory_mb": peak_memory_mb(device)}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def summarize(per_rank: list[dict]) -> dict:
    """Run-level figures from every rank's StepTimer record (queries and tokens are global already)."""
    main = per_rank[0]
    busy = [r["busy"] for r in per_rank]
    return {
        "train_samples_per_s": main["queries"] / main["time"] if main["time"] else 0.0,
        "train_tokens_per_s": main["tokens"] / main["time"] if main["time"] else 0.0,
        # share of the batch slots that hold padding: compute spent on no token
        "padding_share": 1 - main["tokens"] / main["padded"] if main["padded"] else 0.0,
        "data_wait_share": sum(r["wait"] / r["time"] if r["time"] else 0.0 for r in per_rank) / len(per_rank),
        "rank_time_spread": max(busy) / min(busy) if min(busy) > 0 else 1.0,
        "peak_memory_mb_per_rank": [r["peak_memory_mb"] for r in per_rank],
    }


def log_hints(facts: dict, num_workers: int) -> None:
    if facts["data_wait_share"] > DATA_WAIT_HINT:
        log.warning("data loading: %.0f%% of step time waits for batches; raise data.num_workers (now %d)",
                    100 * facts["data_wait_share"], num_workers)
    if facts["rank_time_spread"] > RANK_SPREAD_HINT:
        log.warning("uneven ranks: the slowest takes %.2fx the fastest; check other jobs on those devices, "
                    "CPU threads per rank, or length-skewed batches", facts["rank_time_spread"])
