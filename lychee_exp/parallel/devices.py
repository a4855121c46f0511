"""Which devices a run uses: `parallel` x `gpus` -> a DevicePlan, decided in the Hydra process before launch.

Without CUDA, `gpus=N` with parallel=ddp means N CPU ranks (gloo), each with an equal share of the cores (at most
one rank per core), so that everything multi-device runs and is tested on a laptop or CI machine.

torch is imported where a device is asked about, not at import: config.schema checks `gpus` with parse_gpus, and a
command whose config does not compose ends before torch is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lychee_exp.config.auto import parse_gpus
from lychee_exp.errors import UserError

if TYPE_CHECKING:
    import torch

MAX_AUTO_CPU_RANKS = 4  # beyond this, gloo CPU ranks mostly add communication
RANK_STRATEGIES = ("ddp", "fsdp")  # one process per device


def rank_strategy(strategy: str) -> str:
    """The strategy of a run's ranks: fsdp, or ddp (what every other multi-process run is)."""
    return "fsdp" if strategy == "fsdp" else "ddp"


@dataclass(frozen=True)
class DevicePlan:
    strategy: str  # parallel.strategy: single | dp | ddp | fsdp
    device_type: str  # cuda | cpu
    # devices whose batches make one step: GPUs (dp, ddp on cuda) or CPU ranks (ddp on cpu); 1 for single.
    # metrics.json calls it world_size; DistEnv.world_size is torch's (processes), which differs under dp.
    num_devices: int
    threads_per_rank: int

    @property
    def num_processes(self) -> int:
        return self.num_devices if self.strategy in RANK_STRATEGIES else 1

    def describe(self) -> str:
        if self.device_type == "cpu" and self.strategy in RANK_STRATEGIES:
            sharded = ", sharded (fsdp)" if self.strategy == "fsdp" else ""
            return (
                f"no CUDA GPU: running {self.num_devices} CPU rank(s) with gloo{sharded}, "
                f"{self.threads_per_rank} torch thread(s) each"
            )
        unit = "GPU" if self.device_type == "cuda" else "CPU"
        return f"{self.strategy}: {self.num_devices} {unit}(s), {self.num_processes} process(es)"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_devices(
    strategy: str,
    gpus: object,
    cuda_count: int | None = None,
    cores: int | None = None,
    cpu_threads_per_rank: int = 0,
    cpu_offload: bool = False,
) -> DevicePlan:
    import torch

    requested = parse_gpus(gpus)
    cuda_count = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_count is None else cuda_count
    cores = available_cores() if cores is None else cores
    if strategy == "single":
        if requested not in (None, 1):
            raise UserError(f"parallel=single uses one device but gpus={gpus}; use parallel=ddp gpus={gpus}")
        threads = 1 if cuda_count else cpu_threads_per_rank or cores
        return DevicePlan("single", "cuda" if cuda_count else "cpu", 1, threads)
    if cpu_offload and not cuda_count:
        raise UserError("parallel.cpu_offload=true moves GPU state to CPU memory; CPU ranks hold it there already")
    if strategy == "dp" and not cuda_count:
        raise UserError(
            "parallel=dp needs CUDA GPUs (torch.nn.DataParallel); without them use parallel=ddp, which runs CPU ranks"
        )
    if cuda_count:
        count = cuda_count if requested is None else requested
        if count > cuda_count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
            raise UserError(f"gpus={count} but only {cuda_count} CUDA GPU(s) are visible{where}")
        return DevicePlan(strategy, "cuda", count, max(1, cores // count))
    if requested is not None and requested > cores:
        # as more GPUs than are visible: each rank is a process that wants a core of its own
        raise UserError(
            f"gpus={requested} but no CUDA GPU is visible, so that would be {requested} CPU ranks on {cores} core(s); "
            f"use gpus={cores} or fewer, or gpus=auto"
        )
    count = max(1, min(cores, MAX_AUTO_CPU_RANKS)) if requested is None else requested
    return DevicePlan(rank_strategy(strategy), "cpu", count, cpu_threads_per_rank or max(1, cores // count))


def torch_device(device_type: str, index: int = 0) -> torch.device:
    """The device a process of a plan trains on: CUDA device `index` (its local rank), or the CPU."""
    import torch

    return torch.device("cuda", index) if device_type == "cuda" else torch.device("cpu")
