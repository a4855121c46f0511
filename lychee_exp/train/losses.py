"""Training losses over groups of (1 positive + n negatives) relevance logits, one loss value per query.

`loss.name` picks one from LOSSES: a new loss is one function registered here plus one file in conf/loss (and,
to support distillation, a matching term registered in DISTILL under the same name).

Distillation (loss.distill_weight > 0) adds a term that pulls the student's scores towards a teacher's
(`pos_scores`/`neg_scores` in the data, carried into the batch as `teacher_scores`, one row per group):
- listwise: FlagEmbedding's term, cross-entropy from softmax(teacher / T) to log_softmax(student / T) over the
  group. It depends on teacher score differences only, so any scale works (FlagEmbedding's ~80-100 included).
- pointwise: a soft-target term, binary cross-entropy of each pair's p(yes) = sigmoid(student / T) against
  sigmoid(teacher / T): teacher scores are read as log-odds of relevance (a cross-encoder's logit, yes - no).
Documents without a teacher score (NaN: easy negatives borrowed from other queries) are left out of the term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lychee_exp.config.choices import Registry

LOSSES = Registry("loss.name")
DISTILL = Registry("loss.name (with loss.distill_weight > 0)")


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


@DISTILL.register("listwise")
def listwise_distill(logits: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-sum_i softmax(teacher / T)_i * log_softmax(student / T)_i per group, over documents with a teacher score."""
    known = ~torch.isnan(teacher)
    student = (logits.view_as(teacher) / temperature).masked_fill(~known, float("-inf"))
    target = torch.softmax((teacher / temperature).masked_fill(~known, float("-inf")), dim=-1)
    log_p = torch.log_softmax(student, dim=-1)
    return -torch.where(known, target * log_p, torch.zeros_like(log_p)).sum(dim=-1)


@DISTILL.register("pointwise")
def pointwise_distill(logits: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over a group's scored documents of BCE(sigmoid(student / T), sigmoid(teacher / T))."""
    known = ~torch.isnan(teacher)
    student = logits.view_as(teacher) / temperature
    soft = torch.sigmoid(torch.nan_to_num(teacher) / temperature)
    per_doc = F.binary_cross_entropy_with_logits(student, soft, reduction="none")
    return torch.where(known, per_doc, torch.zeros_like(per_doc)).sum(dim=-1) / known.sum(dim=-1).clamp(min=1)


@dataclass
class RankingLoss:
    """The configured loss: (logits, teacher scores or None) -> (per-query total, per-query distill term or None)."""

    name: str
    group_size: int
    temperature: float = 1.0
    distill_weight: float = 0.0
    distill_temperature: float = 1.0

    def __call__(self, logits: torch.Tensor, teacher: torch.Tensor | None = None):
        loss = LOSSES.lookup(self.name)(logits, self.group_size, self.temperature)
        if self.distill_weight <= 0:
            return loss, None
        if teacher is None:
            raise ValueError("loss.distill_weight > 0 but the batch has no teacher scores")
        distill = DISTILL.lookup(self.name)(
            logits.float(), teacher.to(logits.device, torch.float32), self.distill_temperature
        )
        return loss + self.distill_weight * distill, distill


def build_loss(cfg, group_size: int) -> RankingLoss:
    """From the `loss` config group (LossConfig)."""
    return RankingLoss(cfg.name, group_size, cfg.temperature, cfg.distill_weight, cfg.distill_temperature)
