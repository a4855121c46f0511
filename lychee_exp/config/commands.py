"""Typed schemas of `python -m lychee_exp.mine` and `python -m lychee_exp.rerank` (registered with Hydra's
ConfigStore like the training run's lychee_schema, so a misspelt key or a wrong type fails at composition, naming
the key), and their checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lychee_exp.config.choices import Precision, RankBy, Sampling, Stemmer
from lychee_exp.config.rules import RUN_PREFIX, at_least, check_bounds, check_stage, declared_in, weight
from lychee_exp.config.schema import (
    DEFAULT_ENCODER,
    DataConfig,
    DenseConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainerConfig,
)
from lychee_exp.errors import UserError
from lychee_exp.io.user_files import resolve_path

pass

TEACHERS = ("none", "dense", "reranker")
# mine's relative_margin with the bi-encoder teacher unless given: TopK-PercPos's 5% (its cosines are positive,
# which a relative margin assumes; a reranker's logits are not, so teacher=reranker gets none unless asked)
DENSE_RELATIVE_MARGIN = 0.05


@dataclass
class MineConfig:
    """The keys shared with a run's config are declared there, once (declared_in): the first stage's (data.*),
    the seed, overwrite, the model, the scoring batch (data.eval_batch_size) and the progress bar."""

    dataset: str = MISSING  # a BEIR directory (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)
    split: str = "train"
    first_stage: str = declared_in(DataConfig, "first_stage")  # bm25 | dense | run:<TREC run file>
    dense: DenseConfig = declared_in(DataConfig, "dense")  # the encoder of first_stage=dense and teacher=dense
    dense_model: Optional[str] = None  # alias of dense.model (older commands)
    bm25_stemmer: Stemmer = declared_in(DataConfig, "bm25_stemmer")  # first_stage=bm25's stemmer
    out: str = MISSING  # the JSONL to write
    overwrite: bool = declared_in(RunConfig, "overwrite")  # replace an existing out= (once the new file is complete)
    # negatives from ranks [range_min, range_max) of rank_by's ranking, 0-based. The defaults with sampling=top and
    # the dense teacher's relative_margin are NV-Retriever's TopK-PercPos (docs/beir.md "Choosing the recipe";
    # FlagEmbedding's hn_mine samples 10-210 at random: range_min=10 range_max=210 sampling=random)
    range_min: int = at_least(0, 0)
    range_max: int = at_least(1, 100)
    num_negatives: int = at_least(1, 15)
    # first_stage: the first stage's ranking; teacher: the teacher's ranking of the first stage's top range_max
    rank_by: RankBy = RankBy.first_stage
    sampling: Sampling = Sampling.top  # top: the best ranked candidates left; random: a seeded sample of them
    # dense: the bi-encoder's scores as pos_scores/neg_scores (cosine x 20) for loss=listwise_distill (the default
    # experiment's loss); none: no teacher scores (then train with loss=listwise or pointwise)
    # reranker: a trained reranker's relevance logits (model=<preset> model.path=<run dir>/model)
    teacher: str = "dense"
    model: ModelConfig = declared_in(RunConfig, "model")  # teacher=reranker's model
    batch_size: int = declared_in(DataConfig, "eval_batch_size")  # teacher=reranker: pairs per forward pass
    # with a teacher, against the query's lowest positive score p (sentence-transformers' definitions, in the
    # teacher's scores as written): keep a candidate scoring s <= p - absolute_margin, s <= p * (1 -
    # relative_margin), s <= max_score; null = no such guard, except relative_margin: null = 0.05 with
    # teacher=dense (TopK-PercPos: a candidate within 5% of the positive's cosine is likely an unjudged positive)
    absolute_margin: Optional[float] = None
    margin: Optional[float] = None  # alias of absolute_margin (older commands)
    relative_margin: Optional[float] = None
    max_score: Optional[float] = None
    seed: int = declared_in(RunConfig, "seed")
    # the mining's and dense encoding's progress: a bar on a terminal, else a log line every 30 s or tenth of the
    # phase (rate, time left); false: neither (trainer.progress_bar's meaning)
    progress_bar: bool = declared_in(TrainerConfig, "progress_bar")


@dataclass
class RerankConfig:
    """As MineConfig, the keys shared with a run's config (and mine's dense_model) are declared there, once; top_k
    is data.rerank_top_k's."""

    dataset: str = MISSING
    split: str = "test"
    first_stage: str = declared_in(DataConfig, "first_stage")
    dense: DenseConfig = declared_in(DataConfig, "dense")  # first_stage=dense's encoder
    dense_model: Optional[str] = declared_in(MineConfig, "dense_model")
    bm25_stemmer: Stemmer = declared_in(DataConfig, "bm25_stemmer")
    top_k: int = declared_in(DataConfig, "rerank_top_k")  # first-stage candidates reranked per query
    out: str = MISSING  # directory for run.trec and metrics.json
    overwrite: bool = declared_in(RunConfig, "overwrite")  # replace the results in an existing out= (once complete)
    model: ModelConfig = declared_in(RunConfig, "model")
    parallel: ParallelConfig = declared_in(RunConfig, "parallel")
    gpus: Any = 1  # ranks (GPUs, or CPU processes without CUDA); parallel=ddp gpus=N
    batch_size: int = declared_in(DataConfig, "eval_batch_size")  # pairs per forward pass, batched by length
    # auto: as a run's evaluation scores (trainer.precision=auto), so that its dev figures and rerank's agree: bf16
    # (or fp16) on GPUs, bf16 on CPUs that compute it natively, else fp32; fp32 for scores to the last digit
    precision: Precision = declared_in(TrainerConfig, "precision")
    instruction: Optional[str] = declared_in(DataConfig, "instruction")  # overrides model.prompt.default_instruction
    seed: int = declared_in(RunConfig, "seed")
    # the scoring's and dense encoding's progress: a bar on a terminal, else a log line every 30 s or tenth of the
    # phase (rate, time left); false: neither (trainer.progress_bar's meaning)
    progress_bar: bool = declared_in(TrainerConfig, "progress_bar")
    tag: str = "lychee_exp"  # the run file's tag column
    # run.trec ranks by the model's scores mixed with the teacher's (dense.model's bi-encoder), each standardised
    # per query (ir.fusion): 0 = the model alone; null = the weight the model directory was trained with
    teacher_weight: Optional[float] = weight(None)
    # teacher_* metrics (the bi-encoder teacher alone) beside the model's and the first stage's; null = whenever
    # the model's card names the teacher it was trained against, or teacher_weight > 0 (the mix needs its scores)
    teacher_figures: Optional[bool] = None
    # run.trec also mixes in the first stage's own scores (BM25's: the dense + BM25 hybrid), standardised the same
    # way; null = the weight the model directory was trained with (0 for a model from elsewhere)
    first_stage_weight: Optional[float] = weight(None)


def register_ir_schemas() -> None:
    store = ConfigStore.instance()
    store.store(name="mine_schema", node=MineConfig)
    store.store(name="rerank_schema", node=RerankConfig)


def check_mine_config(cfg: MineConfig) -> None:
    check_bounds(cfg, "")
    _dense_alias(cfg)
    if cfg.range_max <= cfg.range_min:
        raise UserError(f"range_max must be > range_min, got {cfg.range_min}-{cfg.range_max}")
    if cfg.teacher not in TEACHERS:
        raise UserError(f"teacher={cfg.teacher}: expected one of {', '.join(TEACHERS)}")
    if cfg.margin is not None:
        if cfg.absolute_margin is not None and cfg.absolute_margin != cfg.margin:
            raise UserError("margin is an alias of absolute_margin: set one of them")
        cfg.absolute_margin = cfg.margin
    scored = {"margin" if cfg.margin is not None else "absolute_margin": cfg.absolute_margin}
    scored |= {"relative_margin": cfg.relative_margin, "max_score": cfg.max_score}
    scored["rank_by"] = cfg.rank_by if cfg.rank_by == RankBy.teacher else None
    for key, value in scored.items():
        if value is not None and cfg.teacher == "none":
            raise UserError(f"{key}={value} needs a teacher's scores: set teacher=dense or teacher=reranker")
    check_stage(cfg.first_stage)


def mine_settings(cfg: MineConfig) -> MineSettings:
    """The mining settings of a mine command (MineSettings' fields are MineConfig keys of the same names), the
    dense teacher's default relative margin applied."""
    settings = MineSettings(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(MineSettings)})
    if settings.relative_margin is None and cfg.teacher == "dense":
        settings.relative_margin = DENSE_RELATIVE_MARGIN
    return settings


def _dense_alias(cfg) -> None:
    """dense_model=<path>, the key before dense.model, still names the encoder."""
    if cfg.dense_model is None:
        return
    if cfg.dense.model not in (DEFAULT_ENCODER, cfg.dense_model):
        raise UserError("dense_model is an alias of dense.model: set one of them")
    resolve_path(cfg.dense_model, "dense_model")  # a wrong path named by the key the user wrote
    cfg.dense.model = cfg.dense_model


def rerank_config_from(payload: dict) -> RerankConfig:
    """A worker's RerankConfig from the plain dict the launcher hands it (no Hydra in child processes)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RerankConfig), payload))  # type: ignore[return-value]


def check_rerank_config(cfg: RerankConfig) -> None:
    check_bounds(cfg, "")
    _dense_alias(cfg)
    check_stage(cfg.first_stage)


def command_inputs(cfg: MineConfig | RerankConfig) -> list[tuple[str, str]]:
    """What a mine or rerank command reads, as (the key that names it, path): out= must not be or hold any of them
    (io.outputs)."""

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
    for key, spec in (("dense.model", cfg.dense.model), ("model.path", cfg.model.path)):
        if (where := path(spec, key)) is not None:
            found.append((f"{key}={spec}", str(where)))
    if cfg.first_stage.startswith(RUN_PREFIX):
        found.append((f"first_stage={cfg.first_stage}", cfg.first_stage[len(RUN_PREFIX) :]))
    return found


@dataclass(kw_only=True)
class MineSettings:
    """What `mine` keeps, all given by the caller (the mine command's MineConfig holds the defaults)."""

    range_min: int
    range_max: int
    num_negatives: int
    sampling: Sampling
    rank_by: RankBy
    seed: int
    absolute_margin: Optional[float] = None  # None = no guard (each of the three)
    relative_margin: Optional[float] = None
    max_score: Optional[float] = None

    def guards(self) -> dict[str, Callable[[float, float], bool]]:
        """name -> keep(score, lowest positive score), for the guards that are set, in sentence-transformers'
        order (a candidate is counted under the first guard that drops it)."""
        kept = {}
        if self.absolute_margin is not None:
            kept["absolute_margin"] = lambda s, p, m=self.absolute_margin: s <= p - m
        if self.relative_margin is not None:
            kept["relative_margin"] = lambda s, p, r=self.relative_margin: s <= p * (1 - r)
        if self.max_score is not None:
            kept["max_score"] = lambda s, p, top=self.max_score: s <= top
        return kept

    def scores_decide(self) -> bool:
        """Whether the teacher's scores decide which candidates are written (so it scores them all first)."""
        return bool(self.guards()) or self.rank_by == RankBy.teacher
