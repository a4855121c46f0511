"""Hard-negative mining for a split, written as FlagEmbedding's reranker JSONL.

Positives come from the qrels (relevance > 0, their grades kept as `pos_labels`). Negatives are sampled from the
first stage's ranks [range_min, range_max) (0-based, FlagEmbedding's `range_for_sampling` 10-210), never a judged
positive nor the query's own id. With a teacher (a bi-encoder, or a trained reranker) its scores are written as
`pos_scores`/`neg_scores` for distillation, and `margin` guards against false negatives: a candidate the teacher
scores above (the query's lowest positive score - margin) is dropped (sentence-transformers' absolute_margin).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from lychee_exp.core.ir.beir import Corpus, Split
from lychee_exp.core.ir.trec import Run, ranked

# (query id, document id) pairs -> one teacher score each
Teacher = Callable[[list[tuple[str, str]]], list[float]]


@dataclass
class MineSettings:
    range_min: int = 10
    range_max: int = 210
    num_negatives: int = 15
    margin: Optional[float] = None  # teacher-score margin below the lowest positive; None = no guard
    seed: int = 42


@dataclass
class MineSummary:
    written: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> queries
    negatives: int = 0
    false_negatives_dropped: int = 0

    def line(self) -> str:
        mean = self.negatives / self.written if self.written else 0.0
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        guard = (
            f", {self.false_negatives_dropped} candidates dropped by the margin" if self.false_negatives_dropped else ""
        )
        return f"{self.written} queries written, skipped: {skipped}; {mean:.2f} negatives per query{guard}"


def mine(
    corpus: Corpus,
    split: Split,
    run: Run,
    settings: MineSettings,
    teacher: Teacher | None = None,
    progress: Callable[[Iterable], Iterable] = lambda items: items,
) -> tuple[list[dict], MineSummary]:
    summary, plans = MineSummary(), []
    guard = teacher is not None and settings.margin is not None
    for qid in progress(split.query_ids):
        judged = split.qrels[qid]
        positives = sorted((doc for doc, rel in judged.items() if rel > 0), key=lambda d: (-judged[d], d))
        if not positives:  # judged, but nothing relevant: evaluation keeps it, a training line needs a positive
            summary.skipped["without a relevant document"] += 1
            continue
        window = ranked(run.get(qid, {}))[settings.range_min : settings.range_max]
        candidates = [doc for doc, _ in window if judged.get(doc, 0) <= 0 and doc != qid]
        if not candidates:
            summary.skipped[f"without negatives in ranks {settings.range_min}-{settings.range_max}"] += 1
            continue
        if not guard:  # sample now: a teacher then scores only what is written
            candidates = _sample(candidates, settings, qid)
        plans.append((qid, positives, candidates))
    scores = _teacher_scores(plans, teacher)
    lines = []
    for qid, positives, candidates in plans:
        if guard:
            bar = min(scores[qid, d] for d in positives) - settings.margin
            kept = [d for d in candidates if scores[qid, d] <= bar]
            summary.false_negatives_dropped += len(candidates) - len(kept)
            candidates = kept
            if not candidates:
                summary.skipped["whose negatives the margin all dropped"] += 1
                continue
            candidates = _sample(candidates, settings, qid)
        negatives = candidates
        line = {
            "qid": qid,
            "query": split.queries[qid],
            "pos": [corpus.text(d) for d in positives],
            "neg": [corpus.text(d) for d in negatives],
            "pos_labels": [split.qrels[qid][d] for d in positives],
            "pos_ids": positives,
            "neg_ids": negatives,
        }
        if teacher is not None:
            line["pos_scores"] = [round(scores[qid, d], 4) for d in positives]
            line["neg_scores"] = [round(scores[qid, d], 4) for d in negatives]
        lines.append(line)
        summary.written += 1
        summary.negatives += len(negatives)
    return lines, summary


def _sample(candidates: list[str], settings: MineSettings, qid: str) -> list[str]:
    """Seeded per query: the same query gets the same negatives whatever else the split holds."""
    rng = random.Random(f"{settings.seed}:{qid}")
    return rng.sample(candidates, min(settings.num_negatives, len(candidates)))


def _teacher_scores(plans: list, teacher: Teacher | None) -> dict[tuple[str, str], float]:
    """One batch of every pair the teacher is asked about (positives and candidates), so it can sort by length."""
    if teacher is None:
        return {}
    pairs = [(qid, doc) for qid, positives, candidates in plans for doc in positives + candidates]
    return dict(zip(pairs, teacher(pairs)))
