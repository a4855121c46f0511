"""Speed levers of the model on its device: gradient checkpointing decided from memory (`auto`), the LoRA adapters'
dtype path, Liger kernels and torch.compile of the decoder layers (the last two off unless asked for).

`resolve_checkpointing` runs before the model is built (it reads config.json only); `apply_levers` after the model
is on its device and the precision is known, before DDP wraps it.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch
from torch import nn

from lychee_exp.core.config import ModelConfig, RunConfig
from lychee_exp.core.errors import UserError
from lychee_exp.core.model import model_dir
from lychee_exp.core.prompt import PromptEncoder

log = logging.getLogger(__name__)

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MARGIN = 1.3  # the estimate leaves out allocator fragmentation and the backward's transient buffers
GIB = 2**30


def prompt_width(encoder: PromptEncoder) -> int:
    """The most tokens one prompt can have (the widest row a batch can be padded to)."""
    p = encoder.prompt
    if p.max_len:
        return p.max_len
    fields = (p.instruction_max_len or 256) + p.query_max_len + p.doc_max_len
    return encoder.template_len + fields


def activation_bytes(shape: dict, model: ModelConfig, tokens: int, checkpointing: bool, precision: str) -> int:
    """Activations kept for the backward of one micro-step of `tokens` token slots (an estimate, see docs/gpu_check.md):
    per layer and token, the bf16 tensors a decoder layer saves (norm inputs, q/k/v, attention output, four
    MLP-wide tensors) plus the LoRA adapters' own (their dropped-out input, float32 when peft casts it up). With
    checkpointing only each layer's input is kept, plus one layer's activations while it is recomputed."""
    d, ffn, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    e = 2 if precision in ("bf16", "fp16") or model.dtype != "float32" else 4
    per_layer = e * (8 * d + 4 * ffn)
    if model.lora.enabled:
        inputs = 6 * d + ffn  # what the seven adapters read: q/k/v, o, gate/up from d, down from the MLP width
        upcast = model.lora.dtype == "float32" and e == 2
        per_layer += inputs * ((4 if upcast else e if model.lora.dropout > 0 else 0) + (model.lora.dropout > 0))
    if checkpointing:
        return tokens * (layers * d * e + per_layer)
    return tokens * layers * per_layer


def model_shape(model: ModelConfig) -> dict | None:
    config = json.loads((model_dir(model) / "config.json").read_text())
    config = config.get("text_config", config)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    return config if all(k in config for k in keys) else None


def resolve_checkpointing(cfg: RunConfig, encoder: PromptEncoder, device: torch.device) -> tuple[bool, str]:
    """model.gradient_checkpointing as a bool, and why. auto: off on the CPU (memory is not what limits it there);
    on CUDA, off when weights + optimizer state + the micro-step's activations without checkpointing (the token
    budget, data.max_tokens_per_batch, when set; else the widest rows x the rows per micro-step) fit in the
    device's free memory with a margin, else on."""
    value = cfg.model.gradient_checkpointing
    if value != "auto":
        return bool(value), "set"
    if device.type != "cuda":
        return False, "auto: CPU"
    shape = model_shape(cfg.model)
    if shape is None:
        return True, "auto: unknown model shape"
    free, _ = torch.cuda.mem_get_info(device)
    # a token budget bounds a micro-batch's slots by itself (packed: exactly); else the widest rows x rows
    tokens = cfg.data.max_tokens_per_batch or cfg.data.batch_size * cfg.data.train_group_size * prompt_width(encoder)
    d, ffn, layers, vocab = (shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    params = layers * (4 * d * d + 3 * d * ffn) + vocab * d
    weights = params * _BYTES[cfg.model.dtype]
    trainable = params if not cfg.model.lora.enabled else layers * cfg.model.lora.r * (12 * d + 2 * ffn)
    optimizer = trainable * 16  # float32 weight, gradient and two AdamW moments
    activations = activation_bytes(shape, cfg.model, tokens, False, "bf16")
    need = MARGIN * (weights + optimizer + activations)
    why = f"auto: {need / GIB:.1f} GiB estimated without checkpointing ({tokens} token slots), {free / GIB:.1f} free"
    return need > free, why


def resolved_model_config(cfg: RunConfig, encoder: PromptEncoder, device: torch.device) -> ModelConfig:
    """cfg.model with gradient_checkpointing decided (a bool), logged once."""
    on, why = resolve_checkpointing(cfg, encoder, device)
    if cfg.model.gradient_checkpointing == "auto":
        log.info("gradient checkpointing %s (%s)", "on" if on else "off", why)
    return dataclasses.replace(cfg.model, gradient_checkpointing=on)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def apply_levers(model: nn.Module, cfg: ModelConfig, precision: str, device: torch.device) -> nn.Module:
    """The LoRA dtype path, Liger kernels and compiled decoder layers, in place; returns the model."""
    if cfg.lora.enabled:
        _lora_dtype(model, cfg.lora.dtype, precision)
    if cfg.liger_kernel:
        _liger(model, device)
    if cfg.compile_layers:
        for layer in decoder_layers(model):
            layer.compile()  # in place: parameter names (checkpoints, saving) stay as they are
    return model


def _lora_dtype(model: nn.Module, mode: str, precision: str) -> None:
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
    # the LM head's loss kernels are not used: the score reads one position's logits (logits_to_keep=1)
    _apply_liger_kernel_to_instance(model=base, cross_entropy=False, fused_linear_cross_entropy=False)
