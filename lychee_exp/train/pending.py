"""Step statistics that stay on the device until read: a step does not wait for the device to report its loss,
so the host can queue the next step's work. The trainer reads them at each log interval, before evaluations and
checkpoints, and at the end (one device-to-host copy for all unread steps); a non-finite loss then stops the run."""

from __future__ import annotations

import math
import time

import torch

from lychee_exp.errors import TrainingDiverged
from lychee_exp.train.progress import StepFigures


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
