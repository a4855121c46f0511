"""Interpolating a reranker's scores with its teacher's (the bi-encoder that mined and scored its training data):
each query's candidate scores are standardised (zero mean, unit deviation over that query's candidates), then
mixed as (1 - w) * model + w * teacher. The two rankers err on different documents, so the mix can rank better
than either (docs/beir.md has the figures); w = 0 is the model alone, w = 1 the teacher alone.

Standardising per query makes the mix independent of either score's scale (a logit, cosine x 20), which differs
between models and moves during training."""

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


def interpolate(
    model: Sequence[float], teacher: Sequence[float], groups: Sequence[object], weight: float
) -> list[float]:
    """(1 - weight) * standardised model scores + weight * standardised teacher scores, per group (query)."""
    if weight <= 0:
        return [float(s) for s in model]
    z_model, z_teacher = standardise(model, groups), standardise(teacher, groups)
    return [(1 - weight) * m + weight * t for m, t in zip(z_model, z_teacher)]
