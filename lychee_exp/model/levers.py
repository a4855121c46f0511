"""Speed levers of the model on its device: the LoRA adapters' dtype path, Liger kernels and torch.compile of the
decoder layers (the last two off unless asked for).

`apply_levers` runs after the model is on its device and the precision is known, before DDP wraps it (`auto`
checkpointing is decided before the model is built, from parallel.memory_plan's estimate).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lychee_exp.config.schema import ModelConfig
from lychee_exp.errors import UserError

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def apply_levers(model: nn.Module, cfg: ModelConfig, precision: str, device: torch.device) -> nn.Module:
    """The LoRA dtype path, Liger kernels and compiled decoder layers, in place; returns the model."""
    if cfg.lora.enabled:
        lora_dtype(model, cfg.lora.dtype, precision)
    if cfg.liger_kernel:
        _liger(model, device)
    if cfg.compile_layers:
        for layer in decoder_layers(model):
            layer.compile()  # in place: parameter names (checkpoints, saving) stay as they are
    return model


def lora_dtype(model: nn.Module, mode: str, precision: str) -> None:
    adapters = [m for m in model.modules() if hasattr(m, "lora_A")]
    if mode == "model":
        dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
        for module in adapters:
            module.lora_A.to(dtype), module.lora_B.to(dtype)
    elif mode == "auto" and precision in ("bf16", "fp16"):
        # Under autocast the adapter matmuls run in bf16/fp16 whatever their input's dtype: peft's cast of each
        # input up to float32 (a copy per adapter, kept for the backward) buys nothing there.
        for module in adapters:
            module.cast_input_dtype_enabled = False


def _liger(model: nn.Module, device: torch.device) -> None:
    if device.type != "cuda":
        raise UserError("model.liger_kernel=true needs a CUDA device (Liger's kernels are Triton kernels)")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        raise UserError("model.liger_kernel=true needs the liger-kernel package (pip install liger-kernel)") from None
    base = model.backbone.get_base_model() if hasattr(model.backbone, "get_base_model") else model.backbone
    # the LM head's loss kernels are not used: the score reads the head's yes/no rows only (model.answer_head)
    _apply_liger_kernel_to_instance(model=base, cross_entropy=False, fused_linear_cross_entropy=False)
