"""First-stage retrieval, a split's top-k per query: `bm25` (bm25s, Lucene's variant, English stopwords, Porter
stemming by default; the index cached per corpus and stemmer), `dense` (a Hugging Face encoder, cosine;
ir.dense) or `run:<file>` (the user's own TREC run). A document whose id equals the query's is skipped, as
BEIR's evaluation does. Runs are cached by all that decides them (the corpus, the queries asked and their texts,
the stage and its settings, the depth), so DDP ranks and later runs read them instead of retrieving again, and read
back every query asked: one without candidates stays in the run with none (it scores 0)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from importlib.metadata import version
from pathlib import Path

from lychee_exp.config.choices import Stemmer
from lychee_exp.config.rules import RUN_PREFIX, check_stage
from lychee_exp.config.schema import DenseConfig
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.ir.beir import Corpus, Split
from lychee_exp.ir.cache import cache_path, file_key
from lychee_exp.ir.dense import corpus_embeddings, dense_key, embed, top_k_by_blocks
from lychee_exp.ir.trec import Run, as_written, ranked, read_run

log = logging.getLogger(__name__)
BM25_SETTINGS = {"method": "lucene", "stopwords": "en"}  # bm25s' defaults and English stopwords, as _bm25 indexes


def stage_name(spec: str) -> str:
    """bm25 | dense | run: the prefix of the first stage's metrics in training logs (bm25_ndcg@10, ...)."""
    return "run" if spec.startswith(RUN_PREFIX) else spec


def stage_key(
    spec: str, dense: DenseConfig | None = None, stemmer: Stemmer = Stemmer.porter, key: str = "first_stage"
) -> list:
    """What decides a first stage's scores besides the corpus and the queries: BM25's library, settings and
    stemmer, the encoder's settings and files (a model replaced at the same path retrieves again), the run file."""
    if spec == "bm25":
        return ["bm25", BM25_SETTINGS, str(stemmer), version("bm25s")]
    if spec == "dense":
        return ["dense", dense_key(dense or DenseConfig(), key.replace("first_stage", "dense.model"))]
    if spec.startswith(RUN_PREFIX):
        return ["run", file_key(Path(spec[len(RUN_PREFIX) :]).expanduser())]
    return [spec]


def retrieve(
    spec: str,
    corpus: Corpus,
    split: Split,
    top_k: int,
    dense: DenseConfig | None = None,
    key: str = "first_stage",
    stemmer: Stemmer = Stemmer.porter,
) -> Run:
    """Each query's top_k documents and their first-stage scores (as a run file would hold them), every query of
    split.query_ids in that order, those without candidates with none. dense: the encoder of `dense` (default
    all-MiniLM-L6-v2); stemmer: `bm25`'s."""
    check_stage(spec, key)
    dense = dense or DenseConfig()
    cached = run_path(spec, corpus, split, top_k, dense, key, stemmer)
    run = _read_cached(cached, split.query_ids)
    if run is not None:
        return run
    if spec == "bm25":
        run = _bm25(corpus, split, top_k, stemmer)
    elif spec == "dense":
        run = _dense(corpus, split, top_k, dense, key.replace("first_stage", "dense.model"))
    else:
        run = _user_run(Path(spec[len(RUN_PREFIX) :]).expanduser(), corpus, split, top_k)
    # the order a cached read gives back: the queries as asked, each one's documents ranked
    run = {qid: dict(ranked(docs)) for qid, docs in as_written(run).items()}
    run = {qid: run.get(qid, {}) for qid in split.query_ids}
    write_text_atomic(cached, json.dumps({"queries": split.query_ids, "run": run}))
    return run


def run_path(
    spec: str,
    corpus: Corpus,
    split: Split,
    top_k: int,
    dense: DenseConfig | None = None,
    key: str = "first_stage",
    stemmer: Stemmer = Stemmer.porter,
    create: bool = True,
) -> Path:
    """Where the cache keeps this run (ir.cache.cache_path; create=False for a lookup that only reads)."""
    asked = [[qid, split.queries[qid]] for qid in split.query_ids]
    parts = (corpus.key, asked, stage_key(spec, dense or DenseConfig(), stemmer, key), top_k)
    return cache_path("runs", *parts, create=create).with_suffix(".json")


def cached_run(
    spec: str,
    corpus: Corpus,
    split: Split,
    top_k: int,
    dense: DenseConfig | None = None,
    key: str = "first_stage",
    stemmer: Stemmer = Stemmer.porter,
) -> Run | None:
    """The run `retrieve` would give, when an earlier one left it in the cache; else None. Retrieves nothing and
    writes nothing (a check's read)."""
    check_stage(spec, key)
    return _read_cached(run_path(spec, corpus, split, top_k, dense, key, stemmer, create=False), split.query_ids)


def _read_cached(path: Path, query_ids: list[str]) -> Run | None:
    """The cached run, or None when there is none (or it is not whole: then it is computed again)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("queries") != query_ids or list(stored.get("run", {})) != query_ids:
        return None
    return stored["run"]


def _keep_top(qid: str, docs: list[tuple[str, float]], top_k: int) -> dict[str, float]:
    return dict([(doc, score) for doc, score in docs if doc != qid][:top_k])


def _bm25(corpus: Corpus, split: Split, top_k: int, stemmer: Stemmer) -> Run:
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    stem = None if stemmer == Stemmer.none else _stemmer(stemmer)
    index_dir = cache_path("bm25", corpus.key, BM25_SETTINGS, str(stemmer), version("bm25s"))
    if (index_dir / "params.index.json").exists():
        retriever = bm25s.BM25.load(str(index_dir))
    else:
        retriever = bm25s.BM25()
        tokens = bm25s.tokenize(corpus.texts, stopwords="en", stemmer=stem, show_progress=False)
        retriever.index(tokens, show_progress=False)
        tmp = index_dir.with_name(f".{index_dir.name}.{os.getpid()}.tmp")
        try:
            retriever.save(str(tmp))
            with contextlib.suppress(OSError):  # another process saved it first
                tmp.rename(index_dir)  # whole or not at all
        finally:  # what is left of it: a save that failed or was stopped (Ctrl-C), or one another process beat
            shutil.rmtree(tmp, ignore_errors=True)
    texts = [split.queries[qid] for qid in split.query_ids]
    tokens = bm25s.tokenize(texts, stopwords="en", stemmer=stem, return_ids=False, show_progress=False)
    k = min(top_k + 1, len(corpus.ids))  # one more: the query's own id may be among them
    run: Run = {}
    for qid, query_tokens in zip(split.query_ids, tokens):
        if not query_tokens:  # only stopwords: nothing to match
            run[qid] = {}
            continue
        rows, scores = retriever.retrieve([query_tokens], k=k, show_progress=False, n_threads=1)
        docs = [(corpus.ids[int(r)], float(s)) for r, s in zip(rows[0], scores[0])]
        run[qid] = _keep_top(qid, docs, top_k)
    return run


def _stemmer(stemmer: Stemmer):
    import Stemmer as pystemmer  # PyStemmer: Snowball's C stemmers

    return pystemmer.Stemmer(str(stemmer))  # bm25s stems each distinct word once, with its stemWords


def _dense(corpus: Corpus, split: Split, top_k: int, dense: DenseConfig, key: str) -> Run:
    docs = corpus_embeddings(corpus, dense, key)
    queries = embed([split.queries[q] for q in split.query_ids], dense, dense.query_prompt, key, "queries")
    scores, rows = top_k_by_blocks(queries, docs, top_k + 1)  # one more: the query's own id may be among them
    return {
        qid: _keep_top(qid, [(corpus.ids[r], float(s)) for r, s in zip(rows[i], scores[i])], top_k)
        for i, qid in enumerate(split.query_ids)
    }


def _user_run(path: Path, corpus: Corpus, split: Split, top_k: int) -> Run:
    given = read_run(path, "first_stage")
    missing = next((doc for docs in given.values() for doc in docs if doc not in corpus.row), None)
    if missing is not None:
        raise UserError(f"first_stage=run:{path}: document id {missing!r} is not in the corpus")
    absent = [q for q in split.query_ids if q not in given]
    if len(absent) == len(split.query_ids):
        raise UserError(f"first_stage=run:{path}: none of split {split.name!r}'s queries is in the run")
    if absent:
        log.warning("%s: %d of split %s's queries have no candidates", path, len(absent), split.name)
    return {qid: _keep_top(qid, ranked(given.get(qid, {})), top_k) for qid in split.query_ids}
