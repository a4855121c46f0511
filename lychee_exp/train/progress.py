"""Where a run stands (what a checkpoint stores and a resumed run continues from), what one optimizer step
reports, and the hooks a caller runs around each step.

Step statistics stay on the device until read (PendingSteps): a step does not wait for the device to report its
loss, so the host can queue the next step's work. The trainer reads them at each log interval, before evaluations
and checkpoints, and at the end (one device-to-host copy for all unread steps); a non-finite loss then stops the
run."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lychee_exp.errors import TrainingDiverged
from lychee_exp.train.best import Best

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
    best: Best = field(default_factory=Best)  # the best dev evaluation so far and early stopping's count
    source: Path | None = None  # the checkpoint this progress was restored from


def _never() -> bool:
    return False


@dataclass(frozen=True)
class StepHooks:
    """What the caller runs around each optimizer step, on every rank."""

    # called with the step just done and the model it updated (tests inject faults here: errors, damaged weights)
    after_step: Callable[[int, torch.nn.Module], None] | None = None
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


class PendingSteps:
    def __init__(self):
        self._steps: list[tuple[int, torch.Tensor, float, float, float]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, stats: torch.Tensor, grad_norm: torch.Tensor, seconds: float, wait: float, busy: float):
        """`stats`: WindowStep.accumulate's (loss sum, tokens, queries, distill sum, slots); `grad_norm`: a tensor."""
        values = torch.cat([stats, grad_norm.detach().reshape(1).to(stats)])
        self._steps.append((step, values, seconds, wait, busy))

    def read(self, lr: float) -> list[tuple[int, StepFigures]]:
        """Every unread step's figures, in order. Raises TrainingDiverged at the first non-finite loss.

        A step's seconds are host times; the time spent here waiting for the device (work the host had queued
        ahead) is shared among the unread steps in proportion to them, so that they add up to the wall time."""
        if not self._steps:
            return []
        start = time.perf_counter()
        rows = torch.stack([values for _, values, *_ in self._steps]).tolist()  # the one device read
        waited = time.perf_counter() - start
        host = sum(seconds for _, _, seconds, _, _ in self._steps)
        figures = []
        for (step, _, seconds, wait, busy), row in zip(self._steps, rows):
            loss_sum, tokens, queries, distill_sum, padded, grad_norm = row
            loss = loss_sum / queries
            if not math.isfinite(loss):
                self._steps.clear()
                advice = "lower optimizer.lr or use trainer.precision=bf16/fp32"
                raise TrainingDiverged(f"loss is {loss} at step {step} (lr {lr:.3g}); {advice}")
            seconds += waited * seconds / host if host > 0 else waited / len(rows)
            distill = distill_sum / queries
            figures.append((step, StepFigures(loss, distill, queries, tokens, padded, grad_norm, seconds, wait, busy)))
        self._steps.clear()
        return figures
