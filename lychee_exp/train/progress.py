"""Where a run stands (what a checkpoint stores and a resumed run continues from), what one optimizer step
reports, and the hooks a caller runs around each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# the metrics key of a finished run continued with nothing left to train: it holds the step the run had ended at,
# and the run's metrics.json and model/ are left as they were
NOTHING_LEFT = "nothing_left_at_step"


@dataclass
class Progress:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch the next batch belongs to
    batch: int = 0  # the next batch of that epoch (a checkpoint taken mid-epoch resumes there)
    evaluated_at: int = -1  # the step of the last dev evaluation (-1: none yet)
    summary: dict = field(default_factory=dict)  # metrics so far: references, last dev metrics, train loss
    source: Path | None = None  # the checkpoint this progress was restored from


def _never() -> bool:
    return False


@dataclass(frozen=True)
class StepHooks:
    """What the caller runs around each optimizer step, on every rank."""

    after_step: Callable[[int], None] | None = None  # called with the step just done (tests inject faults here)
    stop_requested: Callable[[], bool] = _never  # collective: checkpoint now and stop (preemption)


@dataclass
class StepFigures:
    """One optimizer step, summed over its micro-batches and all ranks (read from the device once per step)."""

    loss: float  # mean loss per query
    distill_loss: float
    queries: float
    tokens: float  # real (non-pad) tokens
    padded: float  # token slots computed, padding included
    grad_norm: float  # before clipping
    seconds: float
    wait: float  # this rank's time waiting for batches
    busy: float  # this rank's time outside collectives


NO_HOOKS = StepHooks()
