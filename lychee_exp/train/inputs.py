"""What a run reads before it trains: the train and dev queries, and the tokenizer with its prompt encoder.
With data=beir, the train file the job's mining step wrote (handed down as data.train_file) and the dev split's
candidates and teacher scores its next step cached (ir.training): read here, never mined, retrieved or scored.

Read once per process: `job.training_job.preflight` loads and checks them in the Hydra process before any rank
starts, and the paths that train in that same process (single, dp, the speedup calibration, a torchrun rank) hand that
object to the Trainer. Spawned DDP ranks load their own. A process that runs several jobs (a sweep worker, a
warm rank) keeps the last inputs it read and reuses them while the settings and files they come from are the
same: they are read-only to training.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from lychee_exp.config.schema import RunConfig
from lychee_exp.data.groups import DevPairs, build_dev_pairs
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.data.queries import RankingQuery, check_negatives, check_teacher_scores, load_queries
from lychee_exp.errors import UserError
from lychee_exp.io.user_files import resolve_path
from lychee_exp.ir.training import BeirDev, beir_dev, beir_train_file, dataset_files, dev_rerank_pairs
from lychee_exp.model.reranker import answer_token_ids, build_encoder, check_model_weights, load_tokenizer


@dataclass
class RunInputs:
    train_queries: list[RankingQuery]
    dev_queries: list[RankingQuery]
    tokenizer: Any  # a transformers tokenizer
    encoder: PromptEncoder
    # token ids of the train prompts, filled once per process by data.token_cache (data.pretokenize)
    token_ids: dict = field(default_factory=dict)
    dev_rerank: BeirDev | None = None  # data=beir: the dev split and its first-stage candidates (dev_queries empty)
    # the dev pairs by (instruction, seed): tokenizing them was most of a warm trial's setup (0.3 s of 0.5 s
    # on the sample set), and they are read-only to training and evaluation
    _dev_pairs: dict = field(default_factory=dict, init=False, repr=False)

    def dev_pairs(self, instruction: str, seed: int) -> DevPairs:
        key = (instruction, seed)
        if key not in self._dev_pairs:
            self._dev_pairs[key] = (
                dev_rerank_pairs(self.dev_rerank, self.encoder, instruction)
                if self.dev_rerank
                else build_dev_pairs(self.dev_queries, self.encoder, instruction, seed)
            )
        return self._dev_pairs[key]


def load_inputs(cfg: RunConfig, warn_unknown: bool = True) -> RunInputs:
    """Reads and checks the data files and the tokenizer; any problem is a UserError naming the key or file:line.
    Unknown data keys are warned about once per file (warn_unknown=False where preflight has already said it)."""
    global _last
    key = _inputs_key(cfg)
    if _last is not None and _last[0] == key:
        return _last[1]
    data = cfg.data
    # data=beir: what the training job's steps left in the cache (ir.training); read here, never computed
    train_file = data.train_file or (beir_train_file(data) if data.dataset else data.train_file)
    dev_rerank = beir_dev(data) if data.dataset else None
    train = load_queries(train_file, "data.train_file", data.max_train_queries, warn_unknown)
    check_negatives(train, data.train_group_size, data.random_negatives)
    if cfg.loss.distill_weight > 0:
        check_teacher_scores(train, "data.train_file")
    dev = [] if dev_rerank else load_queries(data.dev_file, "data.dev_file", data.max_dev_queries, warn_unknown)
    unscored = next((q for q in dev if not q.has_teacher_scores), None) if data.teacher_weight > 0 else None
    if unscored is not None:
        raise UserError(
            f"data.teacher_weight={data.teacher_weight} mixes the dev file's teacher scores into its ranking, but "
            f"{data.dev_file} query {unscored.qid!r} has no pos_scores/neg_scores (add them, or data.teacher_weight=0)"
        )
    tokenizer, encoder = model_inputs(cfg)
    _last = (key, RunInputs(train, dev, tokenizer, encoder, dev_rerank=dev_rerank))
    return _last[1]


def model_inputs(cfg: RunConfig) -> tuple[Any, PromptEncoder]:
    """The tokenizer and its prompt encoder, the model's files checked: any problem is one line naming the key."""
    tokenizer = load_tokenizer(cfg.model)
    if not cfg.model.random_init:  # the ranks load the weights: missing or damaged ones are one line here, first
        check_model_weights(cfg.model)
    encoder = build_encoder(cfg.model, tokenizer)
    answer_token_ids(cfg.model, encoder)  # yes/no must each be one token: one line naming the key, else
    return tokenizer, encoder


_last: tuple[str, RunInputs] | None = None  # this process's last inputs, by what they were read from


def _inputs_key(cfg: RunConfig) -> str:
    """Everything load_inputs reads: the model (tokenizer, prompt), the data settings it applies, and the files
    (path, size, times and inode, so that a file rewritten or replaced between two jobs is read again)."""
    data = cfg.data
    files = []
    for spec, key in ((data.train_file, "data.train_file"), (data.dev_file, "data.dev_file")):
        try:
            stat = resolve_path(spec, key, must_exist=False).stat()
            files.append([spec, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino])
        except (OSError, UserError):  # a missing file: load_inputs names it, in one line
            files.append([spec, None])
    settings = [data.max_train_queries, data.max_dev_queries, data.train_group_size, data.random_negatives]
    settings += [data.dataset, data.train_split, data.dev_split, data.first_stage, data.rerank_top_k]
    settings += [dataclasses.asdict(data.dense), data.bm25_stemmer, data.teacher_weight > 0]
    files.append(dataset_files(data))
    return json.dumps([dataclasses.asdict(cfg.model), settings, cfg.loss.distill_weight > 0, files], default=str)
