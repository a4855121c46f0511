"""Optimizer, learning-rate schedule and the batch-size rules of multi-device training.

`optimizer.name` picks a builder from OPTIMIZERS: a new optimizer is one function registered here (trainable
parameters, lr, the optimizer config -> torch optimizer) plus one file in conf/optimizer.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from lychee_exp.config.auto import uses_fused
from lychee_exp.config.choices import Registry
from lychee_exp.config.schema import OptimizerConfig

OPTIMIZERS = Registry("optimizer.name")
# transformers' names for our schedules (all after a linear warmup)
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


@OPTIMIZERS.register("adamw")
def adamw(params: list[torch.nn.Parameter], lr: float, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    fused = uses_fused(cfg, {p.device.type for p in params})
    betas = tuple(cfg.betas)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)


@OPTIMIZERS.register("sgd")
def sgd(params: list[torch.nn.Parameter], lr: float, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Plain SGD (no momentum): each update is -lr x the gradient, so weights compare gradients directly."""
    return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)


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
