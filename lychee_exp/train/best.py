"""The best dev evaluation of a run and early stopping, as Hugging Face's Trainer has them (`metric_for_best_model`,
`load_best_model_at_end`, `EarlyStoppingCallback(early_stopping_patience, early_stopping_threshold)`), for metrics
that are better higher (all of lychee_exp's).

Only evaluations during training are candidates: the one before training (step 0) is the untrained reference
(`initial_*`), as HF ranks only the evaluations it makes while training. An evaluation is the new best when its
metric beats the best so far at all; early stopping's count starts again only when it beats it by more than the
threshold, and the run stops once `patience` evaluations in a row have not (HF's rule: a string of small gains
can stop a run while the best still moves). The state is part of the run's Progress, so a checkpoint carries it
and a resumed run goes on counting where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lychee_exp.ir.metrics import named_figure


@dataclass
class Best:
    step: int = -1  # the best evaluation's step; -1: none yet
    metrics: dict = field(default_factory=dict)  # its dev metrics, as the evaluation returned them
    stale: int = 0  # evaluations since the last one that beat the best by more than the threshold


def observe(best: Best, step: int, metrics: dict, name: str, threshold: float) -> bool:
    """Counts one evaluation during training into `best`; True when it is the new best."""
    value = named_figure(metrics, name)
    if value is None:
        raise KeyError(f"the dev evaluation has no {name} (it gave {sorted(metrics)})")
    previous = named_figure(best.metrics, name) if best.step >= 0 else None
    best.stale = 0 if previous is None or value - previous > threshold else best.stale + 1
    if previous is not None and value <= previous:
        return False
    best.step, best.metrics = step, dict(metrics)
    return True


def patience_spent(best: Best, patience: int) -> bool:
    """Early stopping's vote: `patience` evaluations in a row without a gain above the threshold (0: never)."""
    return patience > 0 and best.stale >= patience


def best_figures(best: Best, name: str, last: dict, model_is_best: bool) -> dict:
    """What metrics.json says of the best evaluation: its step and figure; where model/ holds its weights
    (load_best_model_at_end), also its dev metrics, which then describe model/, and the last evaluation's figure as
    last_<name>."""
    if best.step < 0:
        return {}
    figures = {"metric_for_best_model": name, "best_step": best.step, "best_metric": named_figure(best.metrics, name)}
    if model_is_best:
        figures.update(best.metrics, **{f"last_{name}": named_figure(last, name)})
    return figures
