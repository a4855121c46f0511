"""Seeds and deterministic mode for one process."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # set both ways: a warm rank's earlier trial may have turned it on
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # Deterministic mode also fills every new tensor's memory (NaN) in case an op reads it uninitialized; none of
    # ours does, and the fill cost 2% of a CPU step (MiniLM, 3 interleaved rounds), more on a GPU's allocations.
    torch.utils.deterministic.fill_uninitialized_memory = False
