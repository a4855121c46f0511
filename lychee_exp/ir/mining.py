"""Hard-negative mining for a split, written as FlagEmbedding's reranker JSONL, with sentence-transformers'
`mine_hard_negatives` options.

Positives come from the qrels (relevance > 0, their grades kept as `pos_labels`). Negatives come from the rank
range [range_min, range_max) (0-based, FlagEmbedding's `range_for_sampling` 10-210) of a ranking of the first
stage's top range_max: the first stage's own (`rank_by=first_stage`) or the teacher's (`rank_by=teacher`), never a
judged positive nor the query's own id. With a teacher (a bi-encoder, or a trained reranker) its scores are written
as `pos_scores`/`neg_scores` for distillation, and three guards against false negatives drop candidates by those
scores, as sentence-transformers defines them against the query's lowest positive score p: `absolute_margin` m
keeps a score s <= p - m, `relative_margin` r keeps s <= p * (1 - r), `max_score` keeps s <= max_score. Of what
is left, `sampling=random` writes a seeded sample of num_negatives, `sampling=top` the num_negatives best ranked
(NV-Retriever's TopK-PercPos is relative_margin=0.05 with sampling=top).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from lychee_exp.config.choices import RankBy, Sampling
from lychee_exp.config.commands import MineSettings
from lychee_exp.ir.beir import Corpus, Split
from lychee_exp.ir.trec import Run, ranked

# (query id, document id) pairs -> one teacher score each
Teacher = Callable[[list[tuple[str, str]]], list[float]]


@dataclass
class MineSummary:
    written: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> queries
    negatives: int = 0
    dropped: Counter = field(default_factory=Counter)  # guard -> candidates it dropped

    def line(self) -> str:
        mean = self.negatives / self.written if self.written else 0.0
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        guards = "".join(f", {n} candidates dropped by {name}" for name, n in sorted(self.dropped.items()))
        return f"{self.written} queries written, skipped: {skipped}; {mean:.2f} negatives per query{guards}"


def mine(
    corpus: Corpus,
    split: Split,
    run: Run,
    settings: MineSettings,
    teacher: Teacher | None = None,
    progress: Callable[[Iterable], Iterable] = lambda items: items,
) -> tuple[list[dict], MineSummary]:
    if teacher is None and settings.scores_decide():
        raise ValueError("the margins, max_score and rank_by=teacher need a teacher")
    summary, plans = MineSummary(), []
    ranks = f"ranks {settings.range_min}-{settings.range_max}"
    for qid in progress(split.query_ids):
        judged = split.qrels[qid]
        positives = sorted((doc for doc, rel in judged.items() if rel > 0), key=lambda d: (-judged[d], d))
        if not positives:  # judged, but nothing relevant: evaluation keeps it, a training line needs a positive
            summary.skipped["without a relevant document"] += 1
            continue
        pool = [doc for doc, _ in ranked(run.get(qid, {}))[: settings.range_max] if doc != qid]
        if settings.rank_by == RankBy.first_stage:
            pool = _negatives_in_range(pool, judged, settings)
            if not pool:
                summary.skipped[f"without negatives in {ranks}"] += 1
                continue
            if not settings.scores_decide():  # choose now: a teacher then scores only what is written
                pool = _choose(pool, settings, qid)
        plans.append((qid, positives, pool))
    scores = _teacher_scores(plans, teacher)
    lines = []
    for qid, positives, candidates in plans:
        if settings.rank_by == RankBy.teacher:  # best first; equal scores keep the first stage's order
            candidates = sorted(candidates, key=lambda d: -scores[qid, d])
            candidates = _negatives_in_range(candidates, split.qrels[qid], settings)
            if not candidates:
                summary.skipped[f"without negatives in the teacher's {ranks}"] += 1
                continue
        if settings.scores_decide():
            lowest = min(scores[qid, d] for d in positives)
            for name, keep in settings.guards().items():
                kept = [d for d in candidates if keep(scores[qid, d], lowest)]
                summary.dropped[name] += len(candidates) - len(kept)
                candidates = kept
            if not candidates:
                summary.skipped["whose candidates the margins or max_score all dropped"] += 1
                continue
            candidates = _choose(candidates, settings, qid)
        line = {
            "qid": qid,
            "query": split.queries[qid],
            "pos": [corpus.text(d) for d in positives],
            "neg": [corpus.text(d) for d in candidates],
            "pos_labels": [split.qrels[qid][d] for d in positives],
            "pos_ids": positives,
            "neg_ids": candidates,
        }
        if teacher is not None:
            line["pos_scores"] = [round(scores[qid, d], 4) for d in positives]
            line["neg_scores"] = [round(scores[qid, d], 4) for d in candidates]
        lines.append(line)
        summary.written += 1
        summary.negatives += len(candidates)
    return lines, summary


def _negatives_in_range(ranking: list[str], judged: dict[str, int], settings: MineSettings) -> list[str]:
    """The documents at ranks [range_min, range_max) of a ranking that are not judged relevant."""
    return [doc for doc in ranking[settings.range_min : settings.range_max] if judged.get(doc, 0) <= 0]


def _choose(candidates: list[str], settings: MineSettings, qid: str) -> list[str]:
    """sampling=top: the first num_negatives (best ranked first); random: seeded per query, so the same query gets
    the same negatives whatever else the split holds."""
    if settings.sampling == Sampling.top:
        return candidates[: settings.num_negatives]
    rng = random.Random(f"{settings.seed}:{qid}")
    return rng.sample(candidates, min(settings.num_negatives, len(candidates)))


def _teacher_scores(plans: list, teacher: Teacher | None) -> dict[tuple[str, str], float]:
    """One batch of every pair the teacher is asked about (positives and candidates), so it can sort by length."""
    if teacher is None:
        return {}
    # each pair once: with rank_by=teacher the candidates hold the positives the first stage found
    pairs = list(dict.fromkeys((qid, doc) for qid, positives, candidates in plans for doc in positives + candidates))
    return dict(zip(pairs, teacher(pairs)))
