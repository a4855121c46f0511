"""What data=beir gives a training run: the train split's mined JSONL (data.train_file, or mined on first use
and cached) and the dev split's first-stage top-k, which the dev evaluation reranks (ir.candidates)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lychee_exp.errors import UserError
from lychee_exp.io.user_files import resolve_path
from lychee_exp.ir.beir import Corpus, Split
from lychee_exp.ir.cache import file_key
from lychee_exp.ir.first_stage import retrieve, stage_key, stage_name
from lychee_exp.ir.pipeline import dense_teacher, mined_train_file, open_split
from lychee_exp.ir.trec import Run

log = logging.getLogger(__name__)


@dataclass
class BeirDev:
    corpus: Corpus
    split: Split
    run: Run  # the first stage's top-k of each dev query
    stage: str  # bm25 | dense | run
    top_k: int
    # (query id, document id) -> the bi-encoder teacher's score: its teacher_* figures, and the mix's with
    # data.teacher_weight > 0 (ir.fusion)
    teacher: dict = field(default_factory=dict)


def beir_dev(data) -> BeirDev:
    corpus, split = open_split(data.dataset, data.dev_split, "data.dataset", "data.dev_split")
    if data.max_dev_queries:  # cut before retrieval: the run (and its cache entry) is of these queries alone
        split = split.head(data.max_dev_queries)
    run = retrieve(
        data.first_stage, corpus, split, data.rerank_top_k, data.dense, "data.first_stage", stemmer=data.bm25_stemmer
    )
    dev = BeirDev(corpus, split, run, stage_name(data.first_stage), data.rerank_top_k)
    # the teacher's figures stand beside the model's at the end of every run (teacher_*), mixed in only with
    # data.teacher_weight > 0; once per process: the corpus embeddings come from the cache mining filled
    pairs = [(qid, doc) for qid in split.query_ids for doc in run.get(qid, {})]
    dev.teacher = dict(zip(pairs, dense_teacher(corpus, split, data.dense, "data.dense.model")(pairs)))
    return dev


def beir_train_file(data) -> str:
    """data.train_file when given; else the train split mined with the defaults (cached after the first use)."""
    corpus, split = open_split(data.dataset, data.train_split, "data.dataset", "data.train_split")
    path = mined_train_file(corpus, split, data.first_stage, data.dense, data.bm25_stemmer)
    log.info("data.train_file: %s (split %s mined with first_stage=%s)", path, split.name, data.first_stage)
    return str(path)


def dev_rerank_pairs(dev: BeirDev, encoder, instruction: str):
    from lychee_exp.ir.candidates import build_rerank_pairs

    pairs = build_rerank_pairs(dev.corpus, dev.split, dev.run, encoder, instruction, dev.stage, dev.top_k)
    if dev.teacher:
        pairs.teacher_scores = [dev.teacher[q, d] for q, d in zip(pairs.qids, pairs.doc_ids)]
    return pairs


def dataset_files(data) -> list:
    """What data=beir's inputs are keyed by: the BEIR directory's contents (each file's path, size, times, inode)
    and the first stage's settings and files (a run file outside the dataset, the encoder); [] without a dataset."""
    if not data.dataset:
        return []
    try:
        root = resolve_path(data.dataset, "data.dataset")
        stage = stage_key(data.first_stage, data.dense, data.bm25_stemmer, "data.first_stage")
        return [file_key(p) for p in sorted(root.rglob("*")) if p.is_file()] + [stage]
    except (OSError, UserError):  # load_inputs names the problem, in one line
        return [data.dataset, data.first_stage, None]
