"""Optimizer, learning-rate schedule and the batch-size rules of multi-device training."""
from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from lychee_exp.config import RunConfig


def effective_batch_size(cfg: RunConfig, num_devices: int) -> int:
    """Queries per optimizer step: per-device batch x devices x accumulation."""
    return cfg.data.batch_size * num_devices * cfg.trainer.grad_accum_steps


def scaled_lr(cfg: RunConfig, num_devices: int) -> float:
    """The multi-GPU guide's rule: keep lr per sample constant as the effective batch grows (linear) or
    grow it with the square root (sqrt, gentler for Adam)."""
    ratio = effective_batch_size(cfg, num_devices) / cfg.optimizer.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.optimizer.lr_scaling]
    return cfg.optimizer.lr * factor


def build_optimizer(cfg: RunConfig, model: torch.nn.Module, lr: float, total_steps: int):
    """AdamW over the trainable parameters; warmup then linear / cosine decay (or constant)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    schedule = {"constant": "constant_with_warmup"}.get(opt.scheduler, opt.scheduler)
    warmup_steps = math.ceil(opt.warmup_ratio * total_steps)
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    return optimizer, scheduler, warmup_steps
