"""Typed schemas of `python -m lychee_exp.mine` and `python -m lychee_exp.rerank` (registered with Hydra's
ConfigStore like the training run's lychee_schema, so a misspelt key or a wrong type fails at composition, naming
the key), and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lychee_exp.core.config import ModelConfig, ParallelConfig, at_least
from lychee_exp.core.errors import UserError
from lychee_exp.core.ir.dense import DEFAULT_ENCODER
from lychee_exp.core.ir.first_stage import RUN_PREFIX, check_stage
from lychee_exp.core.resources import resolve_path

TEACHERS = ("none", "dense", "reranker")


@dataclass
class MineConfig:
    dataset: str = MISSING  # a BEIR directory (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)
    split: str = "train"
    first_stage: str = "bm25"  # bm25 | dense | run:<TREC run file>
    dense_model: str = DEFAULT_ENCODER  # the encoder of first_stage=dense and teacher=dense
    out: str = MISSING  # the JSONL to write
    overwrite: bool = False  # replace an existing out= (only once the new file is complete)
    range_min: int = at_least(0, 10)  # negatives from first-stage ranks [range_min, range_max), 0-based
    range_max: int = at_least(1, 210)
    num_negatives: int = at_least(1, 15)
    # dense: the bi-encoder's scores as pos_scores/neg_scores (cosine x 20) for loss=listwise_distill (the default
    # experiment's loss); none: no teacher scores (then train with loss=listwise or pointwise)
    # reranker: a trained reranker's relevance logits (model=<preset> model.path=<run dir>/model)
    teacher: str = "dense"
    model: ModelConfig = field(default_factory=ModelConfig)  # teacher=reranker's model
    batch_size: int = at_least(1, 64)  # teacher=reranker: pairs per forward pass
    margin: Optional[float] = None  # with a teacher: drop candidates above the lowest positive's score - margin
    seed: int = 42
    progress_bar: bool = True


@dataclass
class RerankConfig:
    dataset: str = MISSING
    split: str = "test"
    first_stage: str = "bm25"
    dense_model: str = DEFAULT_ENCODER
    top_k: int = at_least(1, 100)  # first-stage candidates reranked per query
    out: str = MISSING  # directory for run.trec and metrics.json
    overwrite: bool = False  # replace the results in an existing out= (only once the new ones are complete)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    gpus: Any = 1  # ranks (GPUs, or CPU processes without CUDA); parallel=ddp gpus=N
    batch_size: int = at_least(1, 64)  # pairs per forward pass, batched by length
    instruction: Optional[str] = None  # overrides model.prompt.default_instruction
    seed: int = 42
    progress_bar: bool = True
    tag: str = "lychee_exp"  # the run file's tag column


def register_ir_schemas() -> None:
    store = ConfigStore.instance()
    store.store(name="mine_schema", node=MineConfig)
    store.store(name="rerank_schema", node=RerankConfig)


def check_mine_config(cfg: MineConfig) -> None:
    if cfg.range_max <= cfg.range_min:
        raise UserError(f"range_max must be > range_min, got {cfg.range_min}-{cfg.range_max}")
    if cfg.teacher not in TEACHERS:
        raise UserError(f"teacher={cfg.teacher}: expected one of {', '.join(TEACHERS)}")
    if cfg.margin is not None and cfg.teacher == "none":
        raise UserError("margin needs a teacher to score candidates: set teacher=dense, or margin=null")
    check_stage(cfg.first_stage)


def rerank_config_from(payload: dict) -> RerankConfig:
    """A worker's RerankConfig from the plain dict the launcher hands it (no Hydra in child processes)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RerankConfig), payload))  # type: ignore[return-value]


def check_rerank_config(cfg: RerankConfig) -> None:
    from lychee_exp.core.config import _check_bounds

    _check_bounds(cfg, "")
    check_stage(cfg.first_stage)


def command_inputs(cfg: MineConfig | RerankConfig) -> list[tuple[str, str]]:
    """What a mine or rerank command reads, as (the key that names it, path): out= must not be or hold any of them
    (core.outputs)."""

    def path(spec: str, key: str) -> Path | None:
        try:
            return resolve_path(spec, key, must_exist=False)
        except UserError:
            return None  # a pkg:// path whose package is not installed: the command's own checks say so

    found = []
    root = path(cfg.dataset, "dataset")
    if root is not None:
        found.append((f"dataset={cfg.dataset}", str(root)))
        for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{cfg.split}.tsv"):
            found.append((f"{name} of dataset={cfg.dataset}", str(root / name)))
    for key, spec in (("dense_model", cfg.dense_model), ("model.path", cfg.model.path)):
        if (where := path(spec, key)) is not None:
            found.append((f"{key}={spec}", str(where)))
    if cfg.first_stage.startswith(RUN_PREFIX):
        found.append((f"first_stage={cfg.first_stage}", cfg.first_stage[len(RUN_PREFIX) :]))
    return found
