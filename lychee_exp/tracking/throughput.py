"""Training throughput and the numbers behind the multi-GPU guide's three questions:
out of memory (peak memory per rank), no speedup (share of step time waiting for data), uneven GPU use
(slowest / fastest rank); and the CPU share of the timed window (lychee_exp.tracking.speedup judges it)."""

from __future__ import annotations

import logging
import time

import torch

from lychee_exp.config.auto import effective_batch_size
from lychee_exp.config.choices import MIX
from lychee_exp.config.schema import RunConfig
from lychee_exp.ir.first_stage import stage_name
from lychee_exp.ir.fusion import describe_mix
from lychee_exp.parallel.devices import DevicePlan
from lychee_exp.parallel.distributed import DistEnv, device_name
from lychee_exp.parallel.sharding import state_bytes
from lychee_exp.tracking.keys import HISTORY
from lychee_exp.tracking.memory import peak_rss_mb
from lychee_exp.tracking.phases import PEAKS
from lychee_exp.tracking.speedup import cpu_share

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # the first steps pay for allocator and kernel warm-up; throughput skips them
DATA_WAIT_HINT = 0.2  # share of step time spent waiting for batches that earns a hint
RANK_SPREAD_HINT = 1.25  # slowest / fastest rank compute time that earns a hint


class StepTimer:
    """Times training by the wall clock between step END stamps, taken after everything a step does (its
    collectives, the stop-request all-reduce, logging), minus the dev evaluations and checkpoint writes in between:
    `time` runs from the end of the last warm-up step to the end of the last step, as the peer benchmark times
    other systems. `busy` is a rank's time outside collectives (data wait + forward): backward and the optimizer
    step wait for the slowest rank, so they would hide which rank is slow."""

    def __init__(self, first_step: int, total_steps: int, now: float = 0.0, cpu_now: float | None = None):
        # a run too short to skip warm-up is timed whole (from `now`, before its first step) rather than not at all
        self.timed_from = first_step + WARMUP_STEPS if total_steps - first_step > WARMUP_STEPS else first_step
        self.start = now if self.timed_from == first_step else None
        # moved with `start`: the window's CPU time tells a machine shared with other work
        self.cpu_start = time.process_time() if cpu_now is None else cpu_now
        self.sums = {"time": 0.0, "wait": 0.0, "busy": 0.0, "queries": 0.0, "tokens": 0.0, "padded": 0.0, "cpu": 0.0}

    def add(
        self, step: int, end: float, wait: float, busy: float, queries: float, tokens: float, padded: float
    ) -> None:
        """A step's end stamp and its counts at once (see stamp and count)."""
        self.stamp(step, end)
        self.count(step, wait, busy, queries, tokens, padded)

    def stamp(self, step: int, end: float, cpu_end: float | None = None) -> None:
        """`end`: the step's end stamp on the training clock (wall clock less evaluation time so far), `cpu_end`
        the process's CPU time less evaluation's. Stamping a step again (after the device drained) moves the
        window's end."""
        cpu_end = time.process_time() if cpu_end is None else cpu_end
        if step == self.timed_from:
            self.start, self.cpu_start = end, cpu_end
        elif step > self.timed_from and self.start is not None:
            self.sums["time"] = end - self.start
            self.sums["cpu"] = cpu_end - self.cpu_start

    def count(self, step: int, wait: float, busy: float, queries: float, tokens: float, padded: float) -> None:
        """A timed step's work, whenever its figures are read from the device: `tokens` real (non-pad) tokens,
        `padded` batch slots, pad included."""
        if step > self.timed_from:
            for key, value in zip(
                ("wait", "busy", "queries", "tokens", "padded"), (wait, busy, queries, tokens, padded)
            ):
                self.sums[key] += value

    def rank_record(self, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's sums, peak memory, CPU share and its bytes of training state (shards under fsdp)."""
        # GPU steps leave the CPU waiting by design: a CPU share says something on CPU ranks only
        threads = torch.get_num_threads()
        share = cpu_share(self.sums["cpu"], self.sums["time"], threads) if device.type == "cpu" else None
        memory = state_bytes(model, optimizer)
        return {**self.sums, "peak_memory_mb": peak_memory_mb(device), "cpu_share": share, **memory}


def setup_facts(
    cfg: RunConfig, env: DistEnv, plan: DevicePlan, lr: float, precision: str, parameters: tuple[int, int]
) -> dict:
    """The run's parallel setup, as logged to W&B's config and written to metrics.json. Two counts differ
    under DataParallel: num_devices (GPUs whose batches make a step) and num_processes (torch's world size)."""
    return {
        "num_devices": plan.num_devices,
        "num_processes": env.world_size,
        "strategy": str(plan.strategy),
        "backend": torch.distributed.get_backend() if env.distributed else "none",
        "per_device_batch_size": cfg.data.batch_size,
        "grad_accum_steps": cfg.trainer.grad_accum_steps,
        "effective_batch_size": effective_batch_size(cfg, plan.num_devices),
        "train_group_size": cfg.data.train_group_size,
        "lr": lr,
        "base_lr": cfg.optimizer.lr,  # lr: optimizer.lr scaled to the effective batch
        "precision": str(precision),
        "device": device_name(env.device),
        "device_type": env.device.type,
        "cpu_threads_per_rank": torch.get_num_threads(),
        "parameters": parameters[0],
        "trainable_parameters": parameters[1],
        # what the dev ranking (the unprefixed dev metrics) mixes into the model's scores; "" = the model alone
        MIX: describe_mix(cfg.data.teacher_weight, cfg.data.first_stage_weight, stage_name(cfg.data.first_stage)),
    }


def peak_memory_mb(device: torch.device) -> float:
    """Peak since this process started, or since the last reset_peak_memory (a warm rank's trial). On CPU the
    resident set's (VmHWM), which the phase figures (tracking.phases) reset at each phase: the highest of theirs."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return max([peak_rss_mb() or 0.0, *PEAKS.snapshot().values()])


def gpu_memory(device: torch.device) -> dict:
    """This process's GPU now, under HISTORY's keys: memory allocated to tensors and reserved by torch's caching
    allocator (the figure that runs out first), both peaks since the job began (reset_peak_memory), and the
    utilisation NVML reports when nvidia-ml-py is installed. {} off CUDA."""
    if device.type != "cuda":
        return {}
    mb = 2**20
    figures = {
        HISTORY["gpu_memory_allocated"]: torch.cuda.memory_allocated(device) / mb,
        HISTORY["gpu_memory_reserved"]: torch.cuda.memory_reserved(device) / mb,
        HISTORY["gpu_peak_allocated"]: torch.cuda.max_memory_allocated(device) / mb,
        HISTORY["gpu_peak_reserved"]: torch.cuda.max_memory_reserved(device) / mb,
    }
    utilization = _gpu_utilization(device)
    if utilization is not None:
        figures[HISTORY["gpu_utilization"]] = utilization
    return figures


_nvml_missing = False  # set on the first failure: without NVML every later step would pay for the same error


def _gpu_utilization(device: torch.device) -> float | None:
    """Percent of the last sample period a kernel ran (torch maps the device through CUDA_VISIBLE_DEVICES)."""
    global _nvml_missing
    if _nvml_missing:
        return None
    try:
        return float(torch.cuda.utilization(device))
    except Exception as err:  # noqa: BLE001 - no pynvml module, no NVML library, or a driver refusing the query
        _nvml_missing = True
        log.info("GPU utilisation not logged (%s); install nvidia-ml-py for it", str(err).splitlines()[0][:120])
        return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: a process that runs several jobs reports each job's own, and its own phases' RSS."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    PEAKS.clear()


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
        # each rank's bytes of parameters, gradients and optimizer state (sharding.state_bytes), and the largest
        # as a scalar for W&B and TensorBoard
        **{f"{key}_per_rank": [r[key] for r in per_rank] for key in main if key.endswith("_bytes")},
        **{key: max(r[key] for r in per_rank) for key in main if key.endswith("_bytes")},
        **({"train_cpu_share": main["cpu_share"]} if main.get("cpu_share") is not None else {}),
    }


def log_hints(facts: dict, num_workers: int) -> None:
    if facts["data_wait_share"] > DATA_WAIT_HINT:
        log.warning(
            "data loading: %.0f%% of step time waits for batches; raise data.num_workers (now %d)",
            100 * facts["data_wait_share"],
            num_workers,
        )
    if facts["rank_time_spread"] > RANK_SPREAD_HINT:
        log.warning(
            "uneven ranks: the slowest takes %.2fx the fastest; check other jobs on those devices, "
            "CPU threads per rank, or length-skewed batches",
            facts["rank_time_spread"],
        )
