"""parallel=fsdp: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) over all ranks of a run.

Each transformer block is one FSDP unit and the Reranker root a last one, so a block's full parameters exist only
while it computes (ZeRO-3); `parallel.reshard_after_forward=false` keeps them gathered from forward to backward
(ZeRO-2-like: less communication, more memory). Parameters, gradients and optimizer state stay sharded as DTensors:
AdamW steps on each rank's shard. Gradients are reduce-scattered as the mean over ranks, as DDP all-reduces them,
so the loss scaling and learning-rate rules are DDP's. Every rank must run the same forwards in the same order
(each gathers parameters from every rank): one forward per micro-batch (trainer.forward_chunks=1) and
evaluation batches in lock-step (ir.evaluate)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from lychee_exp.config.schema import ParallelConfig
from lychee_exp.errors import UserError
from lychee_exp.model.precision import amp_dtype


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model, innermost first: the classes it names in `_no_split_modules`
    (what accelerate and the HF Trainer's FSDP wrapping read), else (e.g. BERT) the items of its longest
    nn.ModuleList of one class."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    if names:
        return [module for module in reversed(list(model.modules())) if type(module).__name__ in names]
    stacks = [
        list(module)
        for module in model.modules()
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1
    ]
    return max(stacks, key=len, default=[])


def shard_model(model: nn.Module, parallel: ParallelConfig, precision: str, device: torch.device) -> nn.Module:
    """fully_shard on every block, then on the root, over all ranks (the default process group); in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    blocks = transformer_blocks(model)
    if not blocks:
        raise UserError(
            "parallel=fsdp: the model names no transformer blocks (_no_split_modules) to shard; use parallel=ddp"
        )
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    # bf16: parameters gathered in bf16 for compute, gradients reduced in fp32 (their sum over ranks keeps its bits)
    dtype = amp_dtype(precision) if precision == "bf16" else None
    options = {
        "mesh": mesh,
        "reshard_after_forward": parallel.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None),
        "offload_policy": CPUOffloadPolicy(pin_memory=True) if parallel.cpu_offload else OffloadPolicy(),
    }
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(train_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Within an accumulation window only the last backward communicates: DDP's no_sync, or FSDP2 keeping the
    unsharded gradients until then (no reduce-scatter per micro-batch)."""
    if is_sharded(train_model):
        train_model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else train_model.no_sync()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients (one per trainable parameter, as backward fills them) and
    optimizer state: the tensors' own sizes, shards under fsdp."""

    def size(tensors) -> int:
        return sum(_local(t).numel() * _local(t).element_size() for t in tensors)

    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": size(model.parameters()),
        "grad_bytes": size(p for p in model.parameters() if p.requires_grad),
        "optimizer_bytes": size(state),
    }


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded state dict, on CPU, on rank 0 (empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unsharded_copy(model: nn.Module, build: Callable[[], nn.Module], is_main: bool) -> nn.Module | None:
    """Collective: on rank 0, a fresh model from `build()` (the same architecture, unsharded) holding the sharded
    model's full weights, e.g. to save it as one Hugging Face directory; None on the other ranks."""
    full = full_state_dict(model)
    if not is_main:
        return None
    copy = build()
    copy.load_state_dict(full)
    return copy
