"""Training losses over groups of (1 positive + n negatives) relevance logits, one loss value per query.

`loss.name` picks one from LOSSES: a new loss is one function registered here plus one file in conf/loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lychee_exp.registry import Registry

LOSSES = Registry("loss.name")


@LOSSES.register("pointwise")
def pointwise(logits: torch.Tensor, group_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Lychee's loss: cross-entropy of yes vs no for every pair (yes for the positive, no for negatives).

    With logit = logit(yes) - logit(no), the yes/no softmax cross-entropy is binary cross-entropy on the logit.
    """
    groups = logits.view(-1, group_size)
    labels = torch.zeros_like(groups)
    labels[:, 0] = 1.0  # each group holds its positive first
    return F.binary_cross_entropy_with_logits(groups, labels, reduction="none").mean(dim=1)


@LOSSES.register("listwise")
def listwise(logits: torch.Tensor, group_size: int, temperature: float = 1.0) -> torch.Tensor:
    """FlagEmbedding's reranker loss: softmax cross-entropy over the group, the positive as target."""
    groups = logits.view(-1, group_size) / temperature
    target = torch.zeros(groups.shape[0], dtype=torch.long, device=groups.device)
    return F.cross_entropy(groups, target, reduction="none")
