"""Ranking data in FlagEmbedding's JSONL format: queries with their candidates, read and checked.

One query per line: {"query": str, "pos": [str, ...], "neg": [str, ...]} and, optionally, "prompt" (this query's
instruction, FlagEmbedding's key; "instruction" is accepted too), "pos_scores"/"neg_scores" (teacher scores, one
per document, for distillation), "pos_labels" (integer relevance gains of the positives, for graded NDCG on dev
files; default 1 each) and "qid". Other keys are reported once per file, then ignored.
A training example is a group: 1 positive + (train_group_size - 1) sampled negatives, with their teacher scores.
Dev files use the same format; each query's pos + neg are the candidates to rerank.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass, field

from lychee_exp.errors import UserError
from lychee_exp.io.user_files import numbered_lines, resolve_path

log = logging.getLogger(__name__)

KNOWN_KEYS = {"query", "pos", "neg", "prompt", "instruction", "pos_scores", "neg_scores", "pos_labels", "qid"}
KNOWN_KEYS |= {"pos_ids", "neg_ids"}  # document ids, written by lychee_exp.mine (read by nothing here)
_LARGEST = sys.float_info.max


@dataclass
class RankingQuery:
    query: str
    pos: list[str]
    neg: list[str] = field(default_factory=list)
    instruction: str | None = None
    qid: str = ""
    pos_scores: list[float] | None = None  # teacher scores, aligned with pos / neg
    neg_scores: list[float] | None = None
    pos_labels: list[int] | None = None  # graded relevance of the positives (dev); None = 1 each

    @property
    def has_teacher_scores(self) -> bool:
        return self.pos_scores is not None and (self.neg_scores is not None or not self.neg)


def load_queries(spec: str, key: str, limit: int = 0, warn_unknown: bool = True) -> list[RankingQuery]:
    """Reads and checks a JSONL file; any problem is one UserError naming file:line. Unknown keys get one
    warning per file (warn_unknown=False where preflight has already said it)."""
    path = resolve_path(spec, key)
    if path.is_dir():
        raise UserError(f"{key}={spec}: {path} is a directory, not a JSONL file")
    queries: list[RankingQuery] = []
    unknown: dict[str, int] = {}  # key -> first line it appears on
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        queries.append(_parse_line(line, f"{path}:{number}", len(queries), unknown, number))
        if limit and len(queries) >= limit:
            break
    if not queries:
        raise UserError(f"{key}={spec}: {path} holds no queries")
    if unknown and warn_unknown:
        # once per file, not per line: a typo in a key must not pass silently, nor flood the log
        log.warning(
            "%s: ignoring unknown key(s) %s (first on line %s); known keys: %s",
            path,
            ", ".join(sorted(unknown)),
            min(unknown.values()),
            ", ".join(sorted(KNOWN_KEYS)),
        )
    return queries


def json_object(line: str, where: str, fields: str) -> dict:
    """One JSONL line as a dict; anything else is one UserError naming file:line (`fields`: what it should hold)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with {fields}, got {type(record).__name__}")
    return record


def _parse_line(line: str, where: str, index: int, unknown: dict[str, int], number: int) -> RankingQuery:
    record = json_object(line, where, "query/pos/neg")
    query = record.get("query")
    if not isinstance(query, str) or not query.strip():
        raise UserError(f"{where}: 'query' must be a non-empty string")
    pos, neg = record.get("pos"), record.get("neg", [])
    for name, value in (("pos", pos), ("neg", neg)):
        if not isinstance(value, list) or not all(isinstance(doc, str) for doc in value):
            raise UserError(f"{where}: '{name}' must be a list of strings")
    if not pos:
        raise UserError(f"{where}: query has no positive ('pos' is empty or missing)")
    for name in ("prompt", "instruction"):
        if record.get(name) is not None and not isinstance(record[name], str):
            raise UserError(f"{where}: '{name}' must be a string")
    instruction = record.get("prompt", record.get("instruction"))
    pos_scores = _numbers(record, "pos_scores", pos, where, float)
    neg_scores = _numbers(record, "neg_scores", neg, where, float)
    if (pos_scores is None) != (neg_scores is None) and neg:
        given = "pos_scores" if pos_scores is not None else "neg_scores"
        raise UserError(
            f"{where}: '{given}' without '{'neg_scores' if given == 'pos_scores' else 'pos_scores'}': "
            "teacher scores must cover every document"
        )
    pos_labels = _numbers(record, "pos_labels", pos, where, int)
    if pos_labels is not None and min(pos_labels) < 1:
        raise UserError(f"{where}: 'pos_labels' must be integer gains >= 1 (negatives are 0)")
    for key in record.keys() - KNOWN_KEYS:
        unknown.setdefault(key, number)
    return RankingQuery(query, pos, neg, instruction, str(record.get("qid", index)), pos_scores, neg_scores, pos_labels)


def _numbers(record: dict, name: str, docs: list[str], where: str, kind: type) -> list | None:
    """An optional list of numbers, one per document of `docs` (pos or neg)."""
    values = record.get(name)
    if values is None:
        return None
    ok = (
        (lambda v: isinstance(v, int) and not isinstance(v, bool))
        if kind is int
        else (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
    )
    if not isinstance(values, list) or not all(ok(v) for v in values):
        raise UserError(f"{where}: '{name}' must be a list of {'integers' if kind is int else 'numbers'}")
    # json reads NaN and Infinity (and ints too large for a float): a NaN teacher score silently turns distillation
    # and the teacher's figures off
    unusable = next((v for v in values if (not math.isfinite(v) if isinstance(v, float) else abs(v) > _LARGEST)), None)
    if unusable is not None:
        raise UserError(f"{where}: '{name}' must hold finite numbers, got {json.dumps(unusable)}")
    if len(values) != len(docs):
        docs_key = name.split("_")[0]
        raise UserError(f"{where}: '{name}' has {len(values)} values but '{docs_key}' has {len(docs)} documents")
    return [kind(v) for v in values]


def check_negatives(queries: list[RankingQuery], group_size: int, random_negatives: int = 0) -> None:
    if group_size - 1 > random_negatives:  # some negatives must come from the file
        for q in queries:
            if not q.neg:
                raise UserError(
                    f"data.train_file: query {q.qid!r} has no negatives, but "
                    f"data.train_group_size={group_size} needs {group_size - 1}"
                )


def check_teacher_scores(queries: list[RankingQuery], key: str) -> None:
    """Distillation needs teacher scores on every line: say so before training, naming the first line without."""
    missing = next((q for q in queries if not q.has_teacher_scores), None)
    if missing is not None:
        raise UserError(
            f"loss.distill_weight > 0 needs teacher scores ('pos_scores' and 'neg_scores'), but {key} "
            f"query {missing.qid!r} has none; add them or set loss.distill_weight=0"
        )
