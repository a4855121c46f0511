"""Whether a run packs its batches (data.packing: true, false or auto), decided without loading torch: the config
checks in the Hydra process use it before any training process starts."""

from __future__ import annotations

import json

from lychee_exp.errors import UserError
from lychee_exp.io.resources import resolve_path

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
