"""Optimizer, learning-rate schedule and the batch-size rules of multi-device training.

`optimizer.name` picks a builder from OPTIMIZERS: a new optimizer is one function registered here (trainable
parameters, lr, the optimizer config -> torch optimizer) plus one file in conf/optimizer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import DTensor

from lychee_exp.config.global_step import check_global_step
from lychee_exp.config.registry import Registry
from lychee_exp.config.schema import OptimizerConfig, RunConfig
from lychee_exp.errors import UserError

OPTIMIZERS = Registry("optimizer.name")
# devices whose fused AdamW kernel torch ships and we test
_FUSED = ("cpu", "cuda")
# transformers' names for our schedules (all after a linear warmup)
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


def uses_fused(cfg: OptimizerConfig, device_types: set[str]) -> bool:
    """optimizer.fused resolved for parameters on these device types (null: fused where torch ships the kernel).
    Fused: one pass over each parameter's memory instead of several per tensor (the 7 x layers LoRA tensors on a
    GPU; on CPU 23 ms instead of 78 ms a step for MiniLM's 22M parameters). transformers' Trainer defaults to it."""
    if cfg.fused is not None:
        return cfg.fused
    return bool(device_types) and device_types <= set(_FUSED)


@OPTIMIZERS.register("adamw")
def adamw(params: list[torch.nn.Parameter], lr: float, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    fused = uses_fused(cfg, {p.device.type for p in params})
    betas = tuple(cfg.betas)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)


@OPTIMIZERS.register("sgd")
def sgd(params: list[torch.nn.Parameter], lr: float, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Plain SGD (no momentum): each update is -lr x the gradient, so weights compare gradients directly."""
    return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)


def effective_batch_size(cfg: RunConfig, num_devices: int) -> int:
    """Queries per optimizer step: per-device batch x devices x accumulation."""
    return cfg.data.batch_size * num_devices * cfg.trainer.grad_accum_steps


def with_global_batch(cfg: RunConfig, num_devices: int) -> RunConfig:
    """`trainer.global_batch_size` (queries) or, with a token budget, `trainer.global_tokens_per_step` reached on
    `num_devices` devices: the accumulation it takes (a one-line error when it does not divide). Without either
    the config is returned as it is."""
    queries, tokens, budget = (
        cfg.trainer.global_batch_size,
        cfg.trainer.global_tokens_per_step,
        cfg.data.max_tokens_per_batch,
    )
    if queries is None and tokens is None:
        return cfg
    check_global_step(queries, tokens, budget)
    if queries is not None:
        key, target, per_step, unit = "trainer.global_batch_size", queries, cfg.data.batch_size, "data.batch_size"
    else:
        key, target, per_step, unit = "trainer.global_tokens_per_step", tokens, budget, "data.max_tokens_per_batch"
    if target < 1:
        raise UserError(f"{key}={target}: must be >= 1 (or null)")
    if target % (per_step * num_devices):
        raise UserError(
            f"{key}={target} is not a multiple of {unit}={per_step} x {num_devices} device(s) = "
            f"{per_step * num_devices}: change one of them"
        )
    accumulation = target // (per_step * num_devices)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, grad_accum_steps=accumulation))


def scaled_lr(cfg: RunConfig, num_devices: int, mean_batch: float | None = None) -> float:
    """The multi-GPU guide's rule: keep lr per sample constant as the effective batch grows (linear) or
    grow it with the square root (sqrt, gentler for Adam). `mean_batch`: the mean queries per step of a token
    budget's plan (data.max_tokens_per_batch), whose steps vary in size, instead of the configured batch."""
    batch = effective_batch_size(cfg, num_devices) if mean_batch is None else mean_batch
    ratio = batch / cfg.optimizer.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.optimizer.lr_scaling]
    return cfg.optimizer.lr * factor


def optimizer_step(model: torch.nn.Module, optimizer, scheduler, scaler, cfg: OptimizerConfig) -> torch.Tensor:
    """Unscale (fp16), clip the trainable parameters' gradients to cfg.max_grad_norm (0: no clipping), step the
    optimizer and the schedule, clear the gradients; returns the gradient norm before clipping, as a device
    tensor (reading it would wait for the device)."""
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
    if isinstance(grad_norm, DTensor):  # fsdp: clipped by the norm over every shard; that norm as one tensor
        grad_norm = grad_norm.full_tensor()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def build_optimizer(cfg: OptimizerConfig, model: torch.nn.Module, lr: float, total_steps: int):
    """The configured optimizer over the trainable parameters; warmup then linear / cosine decay (or constant).
    Returns (optimizer, scheduler, warmup steps)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = OPTIMIZERS.lookup(cfg.name)(trainable, lr, cfg)
    warmup_steps = math.ceil(cfg.warmup_ratio * total_steps)
    # here, not at import: transformers' schedules module pulls its trainer utilities (peft, accelerate), which the
    # Hydra process, checking a config, does not need
    from transformers import get_scheduler

    scheduler = get_scheduler(
        _SCHEDULES[cfg.scheduler], optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
    )
    return optimizer, scheduler, warmup_steps
