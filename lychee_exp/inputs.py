"""What a run reads before it trains: the train and dev queries, and the tokenizer with its prompt encoder.

Read once per process: `run.preflight` loads and checks them in the Hydra process before any rank starts, and
the paths that train in that same process (single, dp, the speedup calibration, a torchrun rank) hand that
object to the Trainer. Spawned DDP ranks are fresh processes and load their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lychee_exp.config import RunConfig
from lychee_exp.data import RankingQuery, check_negatives, check_teacher_scores, load_queries
from lychee_exp.model import answer_token_ids, build_encoder, load_tokenizer
from lychee_exp.prompt import PromptEncoder


@dataclass
class RunInputs:
    train_queries: list[RankingQuery]
    dev_queries: list[RankingQuery]
    tokenizer: Any  # a transformers tokenizer
    encoder: PromptEncoder


def load_inputs(cfg: RunConfig, warn_unknown: bool = True) -> RunInputs:
    """Reads and checks the data files and the tokenizer; any problem is a UserError naming the key or file:line.
    Unknown data keys are warned about once per file (warn_unknown=False where preflight has already said it)."""
    data = cfg.data
    train = load_queries(data.train_file, "data.train_file", data.max_train_queries, warn_unknown)
    check_negatives(train, data.train_group_size, data.random_negatives)
    if cfg.loss.distill_weight > 0:
        check_teacher_scores(train, "data.train_file")
    dev = load_queries(data.dev_file, "data.dev_file", data.max_dev_queries, warn_unknown)
    tokenizer = load_tokenizer(cfg.model)
    encoder = build_encoder(cfg.model, tokenizer)
    answer_token_ids(cfg.model, encoder)  # yes/no must each be one token: one line naming the key, else
    return RunInputs(train, dev, tokenizer, encoder)
