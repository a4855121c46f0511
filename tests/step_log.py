"""A step hook for tests that follow every rank (LYCHEE_STEP_HOOK=step_log:step_log): each rank appends each
optimizer step it takes to <LYCHEE_STEP_LOG>/rank<r>, so that a test reads where every rank stopped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

STEP_LOG_ENV = "LYCHEE_STEP_LOG"


def step_log(rank: int, trial_number: int = -1, batch_size: int = 0) -> Callable[[int, object], None]:
    path = Path(os.environ[STEP_LOG_ENV]) / f"rank{rank}"

    def after_step(step: int, model: object) -> None:
        with path.open("a") as handle:
            handle.write(f"{step}\n")

    return after_step


def steps_taken(directory: Path) -> dict[str, list[int]]:
    """rank<r> -> the steps that rank took, in order."""
    return {path.name: [int(line) for line in path.read_text().split()] for path in sorted(directory.glob("rank*"))}
