"""What data=beir gives a training run, and the steps that make it. The training job runs the steps in its Hydra
process, after the config checks and before any rank starts (job.training_job), each saying what it does and where
it writes, or that it reuses what an earlier run wrote:

1. without data.train_file, `mine_train_split`: the train split mined with mine's defaults (the bi-encoder as
   teacher) into the cache; the ranks are handed that file as their data.train_file;
2. `score_dev_split`: the dev split's first-stage top-k, and the bi-encoder teacher's scores of those candidates,
   into the cache; the dev evaluation reranks them (ir.candidates) and mixes in the teacher (ir.fusion).

Processes that need the same entry at once (the ranks of a torchrun job, each its own Hydra process; sweep trials;
the nodes of a job sharing the cache) compute it once: the others wait for it (ir.cache.computing). What reads the
inputs (train.inputs.load_inputs: the job's checks, every rank) only reads them: `beir_train_file` and `beir_dev`
never mine, retrieve or score, and when a step has not run they refuse in one line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

from lychee_exp.config.choices import Stemmer
from lychee_exp.config.schema import DenseConfig
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.io.progress import progress_meter, progress_shown
from lychee_exp.io.user_files import resolve_path
from lychee_exp.ir.beir import Corpus, Split
from lychee_exp.ir.cache import cache_path, computing, file_key
from lychee_exp.ir.dense import dense_key
from lychee_exp.ir.first_stage import cached_run, retrieve, run_path, stage_key, stage_name
from lychee_exp.ir.pipeline import dense_teacher, mine_train_file, mined_train_path, open_split
from lychee_exp.ir.trec import Run

log = logging.getLogger(__name__)


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


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


def prepare_beir(data, progress_bar: bool = False, phase: Callable[[str], ContextManager] = _no_phase) -> str:
    """data=beir's steps, in order: the train split mined when data.train_file is empty, then the dev split's
    candidates and teacher scores. Returns the train file the ranks are to read (data.train_file, or the mined one).
    Both splits are opened (and checked) before the slow work. progress_bar: the steps' progress shown (a bar on a
    terminal, else log lines: io.progress); `phase(name)` measures each step (mining, dense_teacher: the caller's
    tracking.phases)."""
    _dev_split(data)
    steps = 1 if data.train_file else 2  # "data step": the training steps' own log lines say "step n/N"
    with progress_shown(progress_bar):
        train_file = data.train_file
        if not train_file:
            with phase("mining"):
                train_file = str(mine_train_split(data, f"data step 1/{steps}"))
        with phase("dense_teacher"):
            score_dev_split(data, f"data step {steps}/{steps}")
    return train_file


def mine_train_split(data, step: str = "mining") -> Path:
    """The train split mined with mine's defaults into the cache, or found there; its path."""
    corpus, split = _train_split(data)
    path = mined_train_path(corpus, split, data.first_stage, data.dense, data.bm25_stemmer)
    what = f"split {split.name} of {data.dataset} (first_stage={data.first_stage})"
    if path.exists():
        log.info("%s: reusing %s, mined earlier from %s", step, path, what)
        return path
    with computing(path, _waiting(step, "mining", path)):
        if path.exists():
            log.info("%s: reusing %s, mined meanwhile by the process it waited for", step, path)
            return path
        log.info(
            "%s: mining hard negatives from %s with the dense teacher, as `mine` does by default, into %s "
            "(cached: later runs reuse it)",
            step,
            what,
            path,
        )

        def progress(items):
            return progress_meter(items, desc=f"mine {split.name}", unit="query", units="queries")

        start = time.perf_counter()
        summary = mine_train_file(corpus, split, data.first_stage, data.dense, data.bm25_stemmer, path, progress)
    log.info("%s: mined in %.1f s: %s", step, time.perf_counter() - start, summary.line())
    return path


def score_dev_split(data, step: str = "dev candidates") -> BeirDev:
    """The dev split's first-stage top-k and the dense teacher's score of each candidate, computed into the cache,
    or found there."""
    corpus, split = _dev_split(data)
    path = _teacher_path(data, corpus, split)
    dev = _cached_dev(data, corpus, split, path)
    stage, queries = stage_name(data.first_stage), len(split.query_ids)
    what = f"split {split.name}'s {stage} top-{data.rerank_top_k} ({queries} queries)"
    if dev is not None:
        log.info("%s: reusing %s and its teacher scores, computed earlier: %s", step, what, path)
        return dev
    with computing(path, _waiting(step, "scoring", path)):
        dev = _cached_dev(data, corpus, split, path)
        if dev is not None:
            log.info("%s: reusing %s, scored meanwhile by the process it waited for", step, path)
            return dev
        log.info(
            "%s: retrieving %s and scoring it with the dense teacher (data.dense.model=%s) into %s "
            "(cached: later runs reuse it)",
            step,
            what,
            data.dense.model,
            path,
        )
        start = time.perf_counter()
        run = retrieve(
            data.first_stage, corpus, split, data.rerank_top_k, data.dense, "data.first_stage", data.bm25_stemmer
        )
        pairs = [(qid, doc) for qid in split.query_ids for doc in run.get(qid, {})]
        scores = dense_teacher(corpus, split, data.dense, "data.dense.model")(pairs)
        by_query: dict[str, dict[str, float]] = {qid: {} for qid in split.query_ids}
        for (qid, doc), score in zip(pairs, scores):
            by_query[qid][doc] = score
        write_text_atomic(path, json.dumps({"queries": split.query_ids, "scores": by_query}))
    log.info("%s: %d candidates scored in %.1f s", step, len(pairs), time.perf_counter() - start)
    return _dev(data, corpus, split, run, dict(zip(pairs, scores)))


def beir_dev(data) -> BeirDev:
    """The dev split's candidates and teacher scores as score_dev_split left them in the cache. A check's read:
    nothing is retrieved or scored; without them, one line."""
    corpus, split = _dev_split(data)
    dev = _cached_dev(data, corpus, split, _teacher_path(data, corpus, split, create=False))
    if dev is None:
        raise UserError(
            f"data.dev_split={data.dev_split}: its {stage_name(data.first_stage)} top-{data.rerank_top_k} and the "
            "teacher's scores of them are not computed yet (a check only reads them): a training job on this "
            "data=beir config computes them as a step before its checks"
        )
    return dev


def beir_train_file(data) -> str:
    """The train split as the training job's mining step left it in the cache. A check's read: nothing is mined;
    not mined yet, one line that says how to mine it."""
    corpus, split = _train_split(data)
    path = mined_train_path(corpus, split, data.first_stage, data.dense, data.bm25_stemmer, create=False)
    if not path.is_file():
        raise UserError(
            f"data.train_file is empty and split {split.name} is not mined yet (a check never mines): a training "
            f"job mines it as its first step, or mine it yourself with `{mine_command(data, 'train.jsonl')}` "
            "and pass data.train_file=train.jsonl"
        )
    log.info("data.train_file: %s (split %s mined earlier with first_stage=%s)", path, split.name, data.first_stage)
    return str(path)


def mine_command(data, out: str) -> str:
    """The `mine` command that writes what the mining step caches: the same split, first stage and encoder."""
    args = [f"dataset={data.dataset}", f"split={data.train_split}", f"first_stage={data.first_stage}"]
    if data.bm25_stemmer != Stemmer.porter:
        args.append(f"bm25_stemmer={data.bm25_stemmer}")
    default = DenseConfig()
    for name, value in dataclasses.asdict(data.dense).items():
        if value != getattr(default, name):
            args.append(f"dense.{name}={value}")
    return shlex.join(["python", "-m", "lychee_exp.mine", *args, f"out={out}"])


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


def _train_split(data) -> tuple[Corpus, Split]:
    return open_split(data.dataset, data.train_split, "data.dataset", "data.train_split")


def _dev_split(data) -> tuple[Corpus, Split]:
    corpus, split = open_split(data.dataset, data.dev_split, "data.dataset", "data.dev_split")
    if data.max_dev_queries:  # cut before retrieval: the run (and its cache entry) is of these queries alone
        split = split.head(data.max_dev_queries)
    return corpus, split


def _teacher_path(data, corpus: Corpus, split: Split, create: bool = True) -> Path:
    """The cache entry of the teacher's scores of the dev candidates: keyed by the candidates' run (its own cache
    key) and the encoder (its settings, query prompt included, and files)."""
    run = run_path(
        data.first_stage, corpus, split, data.rerank_top_k, data.dense, "data.first_stage", data.bm25_stemmer, False
    )
    teacher = dense_key(data.dense, "data.dense.model")
    return cache_path("teacher", run.name, teacher, create=create).with_suffix(".json")


def _cached_dev(data, corpus: Corpus, split: Split, teacher_path: Path) -> BeirDev | None:
    """The dev candidates and their teacher scores (at teacher_path, _teacher_path's) from the cache, when both
    are there whole; else None."""
    run = cached_run(
        data.first_stage, corpus, split, data.rerank_top_k, data.dense, "data.first_stage", data.bm25_stemmer
    )
    if run is None:
        return None
    try:
        stored = json.loads(teacher_path.read_text())
        teacher = {(qid, doc): float(stored["scores"][qid][doc]) for qid in split.query_ids for doc in run[qid]}
    except (OSError, ValueError, KeyError, TypeError):  # none, or not this run's: scored again
        return None
    return _dev(data, corpus, split, run, teacher)


def _dev(data, corpus: Corpus, split: Split, run: Run, teacher: dict) -> BeirDev:
    # the teacher's figures stand beside the model's at the end of every run (teacher_*), mixed in only with
    # data.teacher_weight > 0
    return BeirDev(corpus, split, run, stage_name(data.first_stage), data.rerank_top_k, teacher)


def _waiting(step: str, doing: str, path: Path):
    def waiting(holder: str) -> None:
        log.info("%s: waiting for %s, which is %s into %s", step, holder or "another process", doing, path)

    return waiting
