"""BEIR datasets: `corpus.jsonl` ({"_id", "title", "text"}), `queries.jsonl` ({"_id", "text"}) and
`qrels/<split>.tsv` (a header row, then `query-id corpus-id score`), as beir-cellar/beir's loader reads them.
A split's queries are every query its qrels judge, those judged only not relevant included (BEIR evaluates them:
they score 0); a split without a qrels file, where the caller allows it (rerank), is every query of queries.jsonl.

Every problem is one UserError naming the file and line, or the id. The corpus is parsed once and cached
(ir.cache): later runs, and every DDP rank, load the pickle instead of the JSONL.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from lychee_exp.data.queries import json_object
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_bytes_atomic
from lychee_exp.io.user_files import numbered_lines, resolve_path
from lychee_exp.ir.cache import cache_path, file_key

log = logging.getLogger(__name__)

Qrels = dict[str, dict[str, int]]  # query id -> document id -> graded relevance (0 = judged not relevant)


@dataclass
class Corpus:
    ids: list[str]
    texts: list[str]  # "title text", as BEIR's models read a document
    key: list = field(default_factory=list)  # the file it came from (path, size, mtime): names caches built on it
    row: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self.row = {doc_id: i for i, doc_id in enumerate(self.ids)}

    def text(self, doc_id: str) -> str:
        return self.texts[self.row[doc_id]]


@dataclass
class Split:
    """One split's queries (sorted by id) and all its judgements ({} for a split without qrels)."""

    name: str
    query_ids: list[str]
    queries: dict[str, str]
    qrels: Qrels
    key: list = field(default_factory=list)  # the queries and qrels files it came from

    def head(self, n: int) -> Split:
        """The first n queries (by id) and their judgements alone."""
        ids = self.query_ids[:n]
        return dataclasses.replace(
            self, query_ids=ids, queries={q: self.queries[q] for q in ids}, qrels=_judged(self.qrels, ids)
        )


def dataset_dir(spec: str, key: str = "dataset") -> Path:
    path = resolve_path(spec, key)
    if not path.is_dir():
        raise UserError(f"{key}={spec}: {path} is not a directory (expected a BEIR dataset)")
    for name in ("corpus.jsonl", "queries.jsonl"):
        if not (path / name).is_file():
            raise UserError(f"{key}={spec}: {path} has no {name} (expected a BEIR dataset)")
    return path


def load_corpus(directory: Path) -> Corpus:
    path = directory / "corpus.jsonl"
    key = file_key(path)
    cached = cache_path("corpus", key).with_suffix(".pkl")
    if cached.exists():
        ids, texts = pickle.loads(cached.read_bytes())
        return Corpus(ids, texts, key)
    ids, texts = [], []
    for where, record in _jsonl(path):
        ids.append(_string(record, "_id", where))
        title, text = record.get("title") or "", record.get("text")
        if not isinstance(text, str) or not isinstance(title, str):
            raise UserError(f"{where}: 'text' (and 'title', when given) must be strings")
        texts.append(f"{title} {text}".strip())
    _no_duplicates(ids, path)
    if not ids:
        raise UserError(f"{path}: the corpus is empty")
    write_bytes_atomic(cached, pickle.dumps((ids, texts), protocol=pickle.HIGHEST_PROTOCOL))
    return Corpus(ids, texts, key)


def load_queries(directory: Path) -> dict[str, str]:
    path = directory / "queries.jsonl"
    queries = {}
    for where, record in _jsonl(path):
        qid, text = _string(record, "_id", where), _string(record, "text", where)
        if qid in queries:
            raise UserError(f"{where}: query id {qid!r} appears twice")
        queries[qid] = text
    return queries


def load_split(directory: Path, split: str, corpus: Corpus, key: str = "split", need_qrels: bool = True) -> Split:
    """need_qrels=False (rerank): without qrels/<split>.tsv, every query of queries.jsonl and no judgements."""
    path = directory / "qrels" / f"{split}.tsv"
    queries = load_queries(directory)
    if path.exists() and not path.is_file():  # not "a split without qrels": rerank would score it unjudged
        raise UserError(f"{key}={split}: {path} is a directory, not a qrels file")
    if not path.is_file():
        if need_qrels:
            raise UserError(f"{key}={split}: no {path}; splits here: {', '.join(split_names(directory)) or 'none'}")
        ids = sorted(queries)
        return Split(split, ids, queries, {}, [file_key(directory / "queries.jsonl")])
    qrels = read_beir_qrels(path)
    for qid, judged in qrels.items():
        if qid not in queries:
            raise UserError(f"{path}: query id {qid!r} is not in {directory / 'queries.jsonl'}")
        missing = next((doc for doc in judged if doc not in corpus.row), None)
        if missing is not None:
            raise UserError(f"{path}: document id {missing!r} (query {qid!r}) is not in {directory / 'corpus.jsonl'}")
    without_relevant = sum(not any(rel > 0 for rel in judged.values()) for judged in qrels.values())
    if without_relevant == len(qrels):
        raise UserError(f"{key}={split}: {path} judges no document relevant (an empty split)")
    if without_relevant:
        log.info(
            "%s: %d queries judged without a relevant document, kept: they score 0, as in BEIR", path, without_relevant
        )
    query_ids = sorted(qrels)
    return Split(
        split,
        query_ids,
        {q: queries[q] for q in query_ids},
        qrels,
        [file_key(path), file_key(directory / "queries.jsonl")],
    )


def split_names(directory: Path) -> list[str]:
    return sorted(p.stem for p in (directory / "qrels").glob("*.tsv") if p.is_file())


def _judged(qrels: Qrels, query_ids: list[str]) -> Qrels:
    return {q: qrels[q] for q in query_ids if q in qrels}


def read_beir_qrels(path: Path) -> Qrels:
    """BEIR's qrels: tab-separated `query-id corpus-id score`. Line 1 is the header when its score column is not a
    number (BEIR's files all have one); a file without a header keeps its first judgement. A (query, document)
    judged twice is an error naming both lines: which grade counts would otherwise be a silent guess."""
    qrels: Qrels = {}
    judged_on: dict[tuple[str, str], int] = {}
    for number, line in numbered_lines(path):
        cols = line.rstrip("\r\n").split("\t")
        if not line.strip() or (number == 1 and len(cols) == 3 and not _parses_as(cols[2], float)):  # the header row
            continue
        where = f"{path}:{number}"
        if len(cols) != 3 or not _parses_as(cols[2], int):
            raise UserError(f"{where}: expected 'query-id<TAB>corpus-id<TAB>score' with an integer score")
        first = judged_on.setdefault((cols[0], cols[1]), number)
        if first != number:
            raise UserError(
                f"{path}: query {cols[0]!r}, document {cols[1]!r} is judged twice (lines {first} and {number}); "
                "keep one grade"
            )
        qrels.setdefault(cols[0], {})[cols[1]] = int(cols[2])
    if not qrels:
        raise UserError(f"{path}: no judgements (an empty split)")
    return qrels


def _jsonl(path: Path):
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        yield where, json_object(line, where, "_id and text")


def _string(record: dict, name: str, where: str) -> str:
    value = record.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and name == "_id":
        value = str(value)
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: '{name}' must be a non-empty string")
    return value


def _no_duplicates(ids: list[str], path: Path) -> None:
    seen: set[str] = set()
    for number, doc_id in enumerate(ids, start=1):
        if doc_id in seen:
            raise UserError(f"{path}: document id {doc_id!r} appears twice (record {number})")
        seen.add(doc_id)


def _parses_as(text: str, kind: type) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True
