"""Mixing a reranker's scores with other rankers' on the same candidates: its teacher's (the bi-encoder that mined
and scored its training data) and the first stage's (BM25's, the ranking it reranks). Each query's candidate
scores are standardised (zero mean, unit deviation over that query's candidates), then mixed as
(1 - sum w) * model + sum w_i * partner_i. Rankers that err on different documents mix into a better ranking than
either (a dense model and BM25 are the classic pair; docs/beir.md has the figures); no weight is the model alone.

Standardising per query makes the mix independent of each score's scale (a logit, cosine x 20, BM25), which
differs between models and moves during training."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence


def standardise(scores: Sequence[float], groups: Sequence[object]) -> list[float]:
    """Each score minus its group's mean, over the group's standard deviation (a constant group: all 0)."""
    rows: dict[object, list[int]] = defaultdict(list)
    for row, group in enumerate(groups):
        rows[group].append(row)
    out = [0.0] * len(scores)
    for members in rows.values():
        values = [float(scores[r]) for r in members]
        mean = math.fsum(values) / len(values)
        deviation = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
        for r, v in zip(members, values):
            out[r] = (v - mean) / deviation if deviation > 0 else 0.0
    return out


def fuse(model: Sequence[float], groups: Sequence[object], partners: Sequence[tuple[Sequence[float], float]]):
    """(1 - sum of weights) * standardised model scores + each weight * that partner's standardised scores, per
    group (query); the model's own scores when no partner weighs anything."""
    partners = [(scores, weight) for scores, weight in partners if weight > 0]
    if not partners:
        return [float(s) for s in model]
    mixed = [(1 - sum(weight for _, weight in partners)) * z for z in standardise(model, groups)]
    for scores, weight in partners:
        mixed = [m + weight * z for m, z in zip(mixed, standardise(scores, groups))]
    return mixed


def interpolate(
    model: Sequence[float], teacher: Sequence[float], groups: Sequence[object], weight: float
) -> list[float]:
    """(1 - weight) * standardised model scores + weight * standardised teacher scores, per group (query)."""
    return fuse(model, groups, [(teacher, weight)])


def describe_mix(teacher_weight: float, first_stage_weight: float, first_stage: str) -> str:
    """What a dev ranking mixes into the model's scores, as the summary line and reports name it ("the teacher at
    0.7", "the first stage (bm25) at 0.3", both joined by "and"); "" for the model alone."""
    parts = [
        f"{name} at {weight:g}"
        for name, weight in (("the teacher", teacher_weight), (f"the first stage ({first_stage})", first_stage_weight))
        if weight > 0
    ]
    return " and ".join(parts)
