"""Typed schema of a run's configuration, and the checks Hydra's types cannot express.

The dataclasses are registered with Hydra's ConfigStore as `lychee_schema`, which `conf/config.yaml` lists first
in its defaults: composing then fails on a misspelt key or a wrong type, naming the key. `check_config` adds the
value checks (lr > 0, ...) and runs in the Hydra process before any training process starts.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lychee_exp.devices import parse_gpus
from lychee_exp.errors import UserError

LYCHEE_PREFIX = "Given the instruction and query, judge whether the document is relevant to the query (yes/no)."


@dataclass
class PromptConfig:
    prefix: str = LYCHEE_PREFIX
    separator: str = "\n"  # between prefix and template
    template: str = "Instruct: {instruction} Query: {query} Document: {document}"
    suffix: str = ""  # e.g. a chat template's assistant opening, so that the next token is the answer
    default_instruction: str = "Given a web search query, retrieve relevant passages that answer the query"
    query_max_len: int = 64  # tokens; the query is truncated to this
    doc_max_len: int = 192  # tokens; the document is truncated, never the template around it
    yes_token: str = "yes"
    no_token: str = "no"


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 64
    alpha: int = 32
    dropout: float = 0.05
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class ModelConfig:
    name: str = MISSING
    # causal_lm: score = p(yes) from the yes/no next-token logits (Lychee);
    # sequence_classification: one logit plays logit(yes) - logit(no) (cross-encoders such as MiniLM)
    kind: str = "causal_lm"
    path: str = MISSING  # a local directory, or pkg://package/sub/dir inside an installed package
    random_init: bool = False  # build the architecture from path's config.json with fresh weights
    dtype: str = "float32"  # dtype of the loaded weights: float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    dropout: Optional[float] = None  # overrides every dropout probability in the model's config; null = keep
    lora: LoraConfig = field(default_factory=LoraConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)


@dataclass
class DataConfig:
    name: str = MISSING
    train_file: str = MISSING
    dev_file: str = MISSING
    instruction: Optional[str] = None  # overrides model.prompt.default_instruction for lines without one
    batch_size: int = 4  # queries per device per micro-step
    train_group_size: int = 8  # 1 positive + (n - 1) sampled negatives per query
    random_negatives: int = 0  # of those negatives, how many are other queries' positives (easy negatives)
    eval_batch_size: int = 64  # (query, document) pairs per forward pass at evaluation
    max_train_queries: int = 0  # 0 = all; a prefix of the file, for quick runs
    max_dev_queries: int = 0
    num_workers: int = 0  # DataLoader workers that tokenize batches
    bucket_by_length: bool = False  # batch queries whose prompts have similar lengths (less padding)
    bucket_pool_batches: int = 64  # optimizer steps' worth of queries sorted by length together


@dataclass
class LossConfig:
    name: str = "pointwise"  # pointwise | listwise
    temperature: float = 1.0  # listwise: softmax over score / temperature


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1e-4  # base learning rate, tuned at base_batch_size (Lychee: 1e-4)
    base_batch_size: int = 4  # effective batch (queries) at which lr applies
    lr_scaling: str = "none"  # none | linear | sqrt: scale lr to the effective batch size
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: str = "linear"  # linear | cosine | constant, after warmup
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0  # 0 disables clipping


@dataclass
class TrainerConfig:
    max_epochs: int = 1
    max_steps: int = -1  # optimizer steps; > 0 overrides max_epochs
    eval_every: int = 0  # optimizer steps between dev evaluations; 0 = after each epoch only
    evaluate: bool = True  # false: train only (throughput calibration and benchmarks)
    eval_before_training: bool = True
    grad_accum_steps: int = 1
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (auto: fp32 on CPU, bf16 on GPUs that support it)
    log_every: int = 5
    progress_bar: bool = True
    deterministic: bool = True
    save_model: bool = True
    checkpoint_every: int = 0  # optimizer steps between checkpoints in <run>/checkpoints; 0 = none
    keep_checkpoints: int = 2
    resume: str = "never"  # never | auto (latest checkpoint in the run directory, if any) | a checkpoint dir


@dataclass
class ParallelConfig:
    strategy: str = "ddp"  # single (one device) | dp (DataParallel, one process) | ddp (one process per device)
    backend: str = "auto"  # auto (nccl on GPUs, gloo on CPU) | nccl | gloo
    max_restarts: int = 0  # elastic restarts of all ranks after a failure; they resume from the latest checkpoint
    find_unused_parameters: bool = False
    timeout_s: int = 1800  # collective timeout; dev evaluation must finish within it
    cpu_threads_per_rank: int = 0  # CPU ranks: torch threads each; 0 = an equal share of the cores


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb: W&B + metrics.csv | csv: metrics.csv in the run directory | none
    project: str = "lychee_exp"
    entity: Optional[str] = None
    mode: str = "auto"  # auto: online with an API key, else offline | online | offline | disabled
    group: Optional[str] = None  # default: the sweep's study name, or the run's name
    job_type: Optional[str] = None  # default: trial in sweeps, else train
    tags: List[str] = field(default_factory=list)
    init_timeout_s: int = 30  # an unreachable server costs at most this, then the run continues offline


@dataclass
class SpeedupConfig:
    """Observed speedup = this run's train samples/s / one device's, same model, lengths, batch, precision."""

    baseline_file: str = "outputs/throughput_baselines.json"  # cache of single-device throughput, by key
    calibrate: bool = True  # without a cached baseline, time a few single-device steps before training
    calibration_steps: int = 4  # timed steps (after 2 warm-up steps)
    baseline_samples_per_s: float = 0.0  # > 0: use this single-device figure (skips cache and calibration)


@dataclass
class TrialConfig:
    """Set by the Optuna sweeper for each trial (never by hand): where rank 0 reports dev metrics for pruning."""

    storage: str = ""  # SQLAlchemy URL of the study; empty = not a sweep trial
    study_name: str = ""
    number: int = -1  # the trial's number in its study (names its directory)
    id: int = -1  # the storage's trial id, to report intermediate values to
    pruner: Dict[str, Any] = field(default_factory=dict)  # _target_ spec of the study's pruner


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 42
    gpus: Any = "auto"  # an int, or auto (all visible GPUs; without CUDA, CPU ranks for the cores)
    optimized_metric: str = "ndcg@10"
    output_dir: str = MISSING
    speedup: SpeedupConfig = field(default_factory=SpeedupConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="lychee_schema", node=RunConfig)


METRIC_NAMES = ("ndcg@10", "mrr@10")
_CHOICES = {
    "model.kind": ("causal_lm", "sequence_classification"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "loss.name": ("pointwise", "listwise"),
    "optimizer.name": ("adamw",),
    "optimizer.lr_scaling": ("none", "linear", "sqrt"),
    "optimizer.scheduler": ("linear", "cosine", "constant"),
    "trainer.precision": ("auto", "fp32", "bf16", "fp16"),
    "parallel.strategy": ("single", "dp", "ddp"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "logger.name": ("wandb", "csv", "none"),
    "logger.mode": ("auto", "online", "offline", "disabled"),
    "optimized_metric": METRIC_NAMES,
}
_POSITIVE = (
    "data.batch_size",
    "data.eval_batch_size",
    "trainer.grad_accum_steps",
    "trainer.log_every",
    "optimizer.base_batch_size",
    "model.prompt.query_max_len",
    "model.prompt.doc_max_len",
    "model.lora.r",
    "parallel.timeout_s",
    "logger.init_timeout_s",
    "speedup.calibration_steps",
    "data.bucket_pool_batches",
)
_NON_NEGATIVE = ("data.random_negatives", "data.max_train_queries", "data.max_dev_queries", "data.num_workers", "trainer.eval_every",
                 "trainer.max_epochs", "optimizer.weight_decay", "optimizer.max_grad_norm",
                 "trainer.checkpoint_every", "trainer.keep_checkpoints", "parallel.max_restarts",
                 "parallel.cpu_threads_per_rank")


def check_config(cfg: DictConfig | RunConfig) -> None:
    """Value checks beyond types; raises UserError naming the key."""
    c: Any = cfg

    def get(key: str) -> Any:
        return OmegaConf.select(c, key) if isinstance(c, DictConfig) else _attr(c, key)

    for key, allowed in _CHOICES.items():
        if get(key) not in allowed:
            raise UserError(f"{key}={get(key)!r} is not one of {', '.join(allowed)}")
    for key in _POSITIVE:
        if get(key) < 1:
            raise UserError(f"{key} must be >= 1, got {get(key)}")
    for key in _NON_NEGATIVE:
        if get(key) < 0:
            raise UserError(f"{key} must be >= 0, got {get(key)}")
    if not get("optimizer.lr") > 0:
        raise UserError(f"optimizer.lr must be > 0, got {get('optimizer.lr')}")
    if not 0 <= get("optimizer.warmup_ratio") < 1:
        raise UserError(f"optimizer.warmup_ratio must be in [0, 1), got {get('optimizer.warmup_ratio')}")
    if not get("loss.temperature") > 0:
        raise UserError(f"loss.temperature must be > 0, got {get('loss.temperature')}")
    group = get("data.train_group_size")
    if get("loss.name") == "listwise" and group < 2:
        raise UserError(f"data.train_group_size must be >= 2 for loss=listwise (1 positive + negatives), got {group}")
    if group < 1:
        raise UserError(f"data.train_group_size must be >= 1, got {group}")
    if get("trainer.max_steps") <= 0 and get("trainer.max_epochs") < 1:
        raise UserError("trainer.max_epochs must be >= 1 when trainer.max_steps <= 0")
    _check_template(get("model.prompt.template"))
    parse_gpus(get("gpus"))


def _check_template(template: str) -> None:
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise UserError(f"model.prompt.template is not a valid format string: {err}") from None
    unknown = set(fields) - {"instruction", "query", "document"}
    if unknown:
        raise UserError(f"model.prompt.template has unknown field(s) {sorted(unknown)}; "
                        "use {instruction}, {query}, {document}")
    for needed in ("query", "document"):
        if fields.count(needed) != 1:
            raise UserError(f"model.prompt.template must contain {{{needed}}} exactly once")


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The resolved, checked, plain-object config that training code reads (no Hydra needed in workers)."""
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.to_container(cfg, resolve=True))
    run_cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    check_config(run_cfg)
    return run_cfg
