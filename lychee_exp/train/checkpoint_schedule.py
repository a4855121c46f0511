"""When a run writes its checkpoints (trainer.checkpoint_every): every N optimizer steps, or (auto, the default) at
an interval measured as the run goes; in both cases also at the last step, before the final dev evaluation, so that
a run killed in that evaluation resumes to just the evaluation (train.trainer).

auto: the first checkpoint after FIRST_AUTO_STEPS steps; after each, the next is due once training has run
1 / OVERHEAD (50) times as long as that checkpoint took to write, counted in steps at the mean step time since
the previous checkpoint. The main rank measures (it writes) and every rank takes its interval
(Trainer._checkpoint shares it), so all ranks checkpoint at the same steps. A disk that slows down or a step that
speeds up moves the interval at the next checkpoint. Hugging Face's Trainer saves every 500 steps, whatever
they cost.
"""

from __future__ import annotations

import math

from lychee_exp.config.auto import checkpoint_every

OVERHEAD = 0.02  # checkpoint writing's share of the training time that auto aims under
FIRST_AUTO_STEPS = 10  # auto's first checkpoint, before any write was measured


def measured_interval(write_s: float, step_s: float) -> int:
    """Optimizer steps between checkpoints that keep a write of write_s seconds at OVERHEAD of steps of step_s."""
    if step_s <= 0:
        return FIRST_AUTO_STEPS
    return max(1, math.ceil(write_s / (OVERHEAD * step_s)))


class CheckpointSchedule:
    """Which steps a run checkpoints at, from trainer.checkpoint_every; `start`: the step the run starts from."""

    def __init__(self, setting, start: int, total_steps: int):
        self.every = checkpoint_every(setting)  # None: auto
        self.total_steps = total_steps
        self.next_auto = start + FIRST_AUTO_STEPS

    @property
    def on(self) -> bool:
        return self.every != 0

    @property
    def auto(self) -> bool:
        return self.every is None

    def due(self, step: int) -> bool:
        if not self.on:
            return False
        if step >= self.total_steps:
            return True  # the trained weights, before the final evaluation
        return step >= self.next_auto if self.auto else step % self.every == 0

    def written(self, step: int, interval: int) -> None:
        """A checkpoint was written at `step`; auto's next is `interval` steps on (measured_interval's)."""
        self.next_auto = step + interval
