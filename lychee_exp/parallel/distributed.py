"""Where this process sits in a run: its rank, the world size and its device, the collectives used, and its seeds
(and deterministic mode)."""

from __future__ import annotations

import inspect
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """world_size is torch's: processes in the process group (DevicePlan.num_devices counts devices)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:  # nanoGPT's master_process: the one rank that logs, saves and reports
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def gather_objects(self, obj: object) -> list:
        """Every rank's obj, on every rank."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def wrap_for_training(model: torch.nn.Module, env: DistEnv, plan, parallel, precision: str) -> torch.nn.Module:
    """FSDP2 (parallel.sharding, in place) or DDP across ranks, DataParallel across one process's GPUs, or the model
    itself. `parallel`: the run's config.schema.ParallelConfig."""
    if plan.strategy == "fsdp":
        from lychee_exp.parallel.sharding import shard_model

        return shard_model(model, parallel, precision, env.device)
    if env.distributed:
        # No buffer here changes in training; syncing buffers would make every forward a synchronisation
        # point (and hide which rank is slow). torch >= 2.13 names the switch forward_sync_buffers.
        params = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets instead of being copied into them
        # (one gradient-sized buffer less; measured no slower on 2 gloo CPU ranks)
        return torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            find_unused_parameters=parallel.find_unused_parameters,
            gradient_as_bucket_view=True,
            **no_sync,
        )
    if plan.strategy == "dp":
        return torch.nn.DataParallel(model, device_ids=list(range(plan.num_devices)))
    return model


# cuBLAS reads this when it creates its handle (the first GEMM on a device), so it is set when this module is imported:
# every process that trains (the job process, spawned, torchrun and warm ranks) imports it before its first GEMM,
# and children inherit it. Without it, deterministic mode on CUDA warns at every cuBLAS GEMM (warn_only=True),
# and with it, cuBLAS picks reproducible reductions at no measurable cost (PyTorch's reproducibility notes). A
# value the user set is kept.
CUBLAS_WORKSPACE = ":4096:8"
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def seed_everything(seed: int, deterministic: bool) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # in case something removed it since import
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # set both ways: a warm rank's earlier trial may have turned it on
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # Deterministic mode also fills every new tensor's memory (NaN) in case an op reads it uninitialized; none of
    # ours does, and the fill cost 2% of a CPU step (MiniLM, 3 interleaved rounds), more on a GPU's allocations.
    torch.utils.deterministic.fill_uninitialized_memory = False
