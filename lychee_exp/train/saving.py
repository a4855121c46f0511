"""The trained model written as one Hugging Face directory (<run>/model), from any strategy's model."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from torch import nn

from lychee_exp.config.schema import ModelConfig, RunConfig
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.model.reranker import load_reranker, save_reranker
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.parallel.sharding import is_sharded, unsharded_copy


def save_model(
    model: nn.Module,
    out_dir: Path,
    model_cfg: ModelConfig,
    encoder: PromptEncoder,
    tokenizer,
    cfg: RunConfig,
    env: DistEnv,
) -> None:
    """Called on every rank; the main rank writes. A sharded model (fsdp) is gathered once into an unsharded copy
    on the main rank (collective), so model/ loads exactly as a DDP run's does. `model_cfg`: the model config the
    run resolved (parallel.memory_plan.resolved_model_config)."""
    if is_sharded(model):
        build = functools.partial(load_reranker, model_cfg, encoder, cfg.seed, training=True)
        model = unsharded_copy(model, build, env.is_main)
    if env.is_main:
        mix = {
            "teacher_weight": cfg.data.teacher_weight,
            "first_stage_weight": cfg.data.first_stage_weight,
            "teacher": dataclasses.asdict(cfg.data.dense),
        }
        save_reranker(model, tokenizer, cfg.model, out_dir, mix)
