"""Every `auto` of a run's configuration, and the batch-size arithmetic of multi-device training, decided without
torch: the config checks in the Hydra process (and the sweeper, on its sample trial) use them before any training
process starts, and the ranks use the same functions, so the two never disagree.

- `gpus`: parse_gpus (the devices themselves: parallel.devices.plan_devices)
- `data.packing`: packing_on; `trainer.forward_chunks`: forward_chunk_count; `optimizer.fused`: uses_fused
- `trainer.checkpoint_every`: checkpoint_every (auto's interval is measured as the run goes: train.checkpoint_schedule)
- the global step: check_global_step, with_global_batch (the accumulation a global batch takes),
  effective_batch_size and scaled_lr (the multi-GPU guide's linear or sqrt rule)

`cfg` is a RunConfig (or its optimizer config), unannotated: the schema imports the rules, which import this module."""

from __future__ import annotations

import dataclasses
import json
import math

from lychee_exp.errors import UserError
from lychee_exp.io.user_files import resolve_path

# Encoder cross-encoders whose sequence-classification head reads each prompt's first token through a pooler and
# one linear layer (model.reranker scores packed rows of these): BERT and the models built on its code (MiniLM)
PACKABLE_ENCODERS = ("bert",)


def check_packing_setting(setting) -> None:
    if not isinstance(setting, bool) and setting != "auto":
        raise UserError(f"data.packing must be true, false or auto, got {setting!r}")


def packing_on(cfg, device_type: str, strategy: str) -> bool:
    """data.packing as a decision (RunConfig `cfg`). auto packs an encoder cross-encoder (PACKABLE_ENCODERS) on
    CPU, where packed rows were measured faster than padded ones in both precisions (docs/performance.md); causal
    LMs, GPUs and DataParallel keep padded rows unless data.packing=true asks."""
    setting = cfg.data.packing
    check_packing_setting(setting)
    if setting != "auto":
        return setting
    model = cfg.model
    if model.kind not in ("sequence_classification", "bi_encoder") or device_type != "cpu" or strategy == "dp":
        return False
    return model.attn_implementation in ("sdpa", "eager") and encoder_model_type(model.path) in PACKABLE_ENCODERS


def encoder_model_type(path: str) -> str | None:
    """config.json's model_type of model.path, or None where it cannot be read (the model's loading reports why)."""
    try:
        return json.loads((resolve_path(path, "model.path") / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, UserError, AttributeError):
        return None


def check_global_step(queries: int | None, tokens: int | None, budget: int | None) -> None:
    """A one-line UserError for a global step that the batches cannot reach."""
    if queries is not None and tokens is not None:
        raise UserError(
            f"trainer.global_batch_size={queries} and trainer.global_tokens_per_step={tokens} both fix the step: "
            "set one of them to null"
        )
    if queries is not None and budget is not None:
        raise UserError(
            f"trainer.global_batch_size={queries} counts queries per step, but data.max_tokens_per_batch={budget} "
            "makes that number vary: fix tokens per step instead (trainer.global_tokens_per_step; "
            "hparams_search=lr_tokens), or set data.max_tokens_per_batch=null"
        )
    if tokens is not None and budget is None:
        raise UserError(
            f"trainer.global_tokens_per_step={tokens} needs a token budget (data.max_tokens_per_batch, as "
            "experiment=lychee_lora sets); without one, fix queries per step: trainer.global_batch_size "
            "(hparams_search=lr_batch)"
        )


# trainer.forward_chunks=auto. CPU: 4 chunks of a 32-pair micro-batch were 1.11x the tokens/s of one pass on the
# sample mix and 1.55x with bucketing on a long-tailed mix (python -m benchmarks.peers, 2-core machine,
# docs/benchmarks.md), with the same logits. CUDA: 1 until a GPU measurement says otherwise (small chunks can
# leave a GPU underused, and data.packing removes the padding there instead).
AUTO_FORWARD_CHUNKS = {"cpu": 4, "cuda": 1}


def forward_chunk_count(setting, device_type: str, strategy: str = "single") -> int:
    """trainer.forward_chunks as a number of chunks for this device type; a bad value is a UserError. fsdp: 1,
    since every rank must run the same forwards (parallel.sharding; other settings are refused by the config)."""
    if setting == "auto":
        if strategy == "fsdp":
            return 1
        return AUTO_FORWARD_CHUNKS.get(device_type, 1)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise UserError(f"trainer.forward_chunks must be auto or an integer >= 1, got {setting!r}")
    return setting


def checkpoint_every(setting) -> int | None:
    """trainer.checkpoint_every as a fixed interval in optimizer steps (0: no checkpoints), or None for auto (an
    interval measured as the run goes: train.checkpoint_schedule); a bad value is a UserError."""
    if setting == "auto":
        return None
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise UserError(f"trainer.checkpoint_every must be auto or an integer >= 0 (0: none), got {setting!r}")
    return setting


# devices whose fused AdamW kernel torch ships and we test
_FUSED = ("cpu", "cuda")


def uses_fused(cfg, device_types: set[str]) -> bool:
    """optimizer.fused resolved for parameters on these device types (null: fused where torch ships the kernel).
    Fused: one pass over each parameter's memory instead of several per tensor (the 7 x layers LoRA tensors on a
    GPU; on CPU 23 ms instead of 78 ms a step for MiniLM's 22M parameters). transformers' Trainer defaults to it."""
    if cfg.fused is not None:
        return cfg.fused
    return bool(device_types) and device_types <= set(_FUSED)


def effective_batch_size(cfg, num_devices: int) -> int:
    """Queries per optimizer step: per-device batch x devices x accumulation."""
    return cfg.data.batch_size * num_devices * cfg.trainer.grad_accum_steps


def with_global_batch(cfg, num_devices: int):
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


def scaled_lr(cfg, num_devices: int, mean_batch: float | None = None) -> float:
    """The multi-GPU guide's rule: keep lr per sample constant as the effective batch grows (linear) or
    grow it with the square root (sqrt, gentler for Adam). `mean_batch`: the mean queries per step of a token
    budget's plan (data.max_tokens_per_batch), whose steps vary in size, instead of the configured batch."""
    batch = effective_batch_size(cfg, num_devices) if mean_batch is None else mean_batch
    ratio = batch / cfg.optimizer.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.optimizer.lr_scaling]
    return cfg.optimizer.lr * factor


def parse_gpus(gpus: object) -> int | None:
    """`auto` -> None, else a positive int; anything else is a one-line error."""
    if isinstance(gpus, str) and gpus.strip().lower() == "auto":
        return None
    try:
        count = int(str(gpus))
    except ValueError:
        raise UserError(f"gpus={gpus!r} must be a positive integer or 'auto'") from None
    if count < 1:
        raise UserError(f"gpus={gpus} must be >= 1 (or 'auto')")
    return count
