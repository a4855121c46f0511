"""The choices of the run configuration. Closed ones: each Enum lists the values its key allows, so that composing a
config with any other value fails naming the key and the allowed values (config.schema types its fields with them).
Open ones (losses, optimizers), extended by registering a function plus one YAML file in its config group, live in
a Registry, which lists the allowed names when a config names another."""

from __future__ import annotations

from enum import Enum
from typing import Callable, TypeVar

from lychee_exp.errors import UserError


class Choice(str, Enum):
    """A closed choice. Member names are the values users write (`trainer.precision=bf16`): OmegaConf matches
    by name, and a member compares, hashes and formats as its value, so code may treat it as that string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ModelKind(Choice):
    causal_lm = "causal_lm"  # score = p(yes) from the yes/no next-token logits (Lychee)
    sequence_classification = "sequence_classification"  # one logit plays logit(yes) - logit(no)
    bi_encoder = "bi_encoder"  # query and document encoded apart: cosine x 20 (model.bi_encoder)


class Score(Choice):
    yes_minus_no = "yes_minus_no"  # logit(yes) - logit(no): softmax over yes/no (Lychee, Qwen3-Reranker)
    yes_logit = "yes_logit"  # the raw yes logit (FlagEmbedding's decoder-only rerankers)


class Dtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LrScaling(Choice):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class Schedule(Choice):
    linear = "linear"
    cosine = "cosine"
    constant = "constant"


class Precision(Choice):
    auto = "auto"  # bf16 on GPUs that support it, else fp16; bf16 on CPUs that compute it natively, else fp32
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class PackingFallback(Choice):
    none = "none"  # data.packing on CUDA without a working varlen kernel stops at setup, in one line
    sdpa = "sdpa"  # then packed rows go through one causal sdpa call per prompt per layer (slower)


class Strategy(Choice):
    single = "single"  # one device
    dp = "dp"  # DataParallel, one process
    ddp = "ddp"  # one process per device
    fsdp = "fsdp"  # one process per device; parameters, gradients and optimizer state sharded (FSDP2)


class Backend(Choice):
    auto = "auto"  # nccl on GPUs, gloo on CPU
    nccl = "nccl"
    gloo = "gloo"


class LoggerName(Choice):
    wandb = "wandb"  # W&B + metrics.csv
    csv = "csv"  # metrics.csv in the run directory
    tensorboard = "tensorboard"  # TensorBoard event files in <run>/tensorboard + metrics.csv
    none = "none"


class LoggerMode(Choice):
    auto = "auto"  # online with an API key, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"


# A training run's dev metrics name the model's own figures model_* (every evaluation) and the run's ranking
# unprefixed: the model's scores mixed with the teacher's or the first stage's when data.teacher_weight or
# data.first_stage_weight > 0 (ir.fusion), which metrics.json's `mix` describes ("" for the model alone), else the
# model's figures again (readers of older runs: lychee_exp.ir.metrics.model_figure / mix_figure)
MODEL_PREFIX = "model_"
MIX = "mix"
# the names hold "@", so the functional form; module and qualname let ranks unpickle its members
Metric = Choice(
    "Metric",
    {name: name for name in (f"{MODEL_PREFIX}ndcg@10", f"{MODEL_PREFIX}mrr@10", "ndcg@10", "mrr@10")},
    module=__name__,
    qualname="Metric",
)


class Pooling(Choice):
    mean = "mean"  # the mean of the token embeddings (sentence-transformers' MiniLM, E5)
    cls = "cls"  # the first token's embedding (BGE)
    last = "last"  # the last non-padding token's embedding (Qwen3-Embedding and other decoder encoders)


class Sampling(Choice):
    random = "random"  # a seeded sample of the candidates left (FlagEmbedding's hn_mine)
    top = "top"  # the highest-ranked candidates left (sentence-transformers' sampling_strategy="top")


class RankBy(Choice):
    first_stage = "first_stage"  # the rank range is over the first stage's ranking
    teacher = "teacher"  # over the teacher's ranking of the first stage's top range_max


class Stemmer(Choice):
    # Porter's stemmer, as Lucene's EnglishAnalyzer (Anserini/pyserini) and Elasticsearch's "english" analyzer
    # (BEIR's BM25 runs) stem; both via PyStemmer
    porter = "porter"
    english = "english"  # Snowball's English (Porter 2) stemmer
    none = "none"  # words as they are, lowercased


F = TypeVar("F", bound=Callable)


class Registry(dict):
    def __init__(self, key: str):
        super().__init__()
        self.key = key  # the config key that names a part, for error messages

    def register(self, name: str) -> Callable[[F], F]:
        def add(part: F) -> F:
            if name in self:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self[name] = part
            return part

        return add

    def lookup(self, name: str) -> Callable:
        if name not in self:
            raise UserError(f"{self.key}={name!r} is not one of {', '.join(sorted(self))}")
        return self[name]
