"""Seeds and deterministic mode for one process."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

# cuBLAS reads this when it creates its handle (the first GEMM on a device), so it is set when this module is imported:
# every process that trains (the job process, spawned, torchrun and warm ranks) imports it before its first GEMM,
# and children inherit it. Without it, deterministic mode on CUDA warns at every cuBLAS GEMM (warn_only=True),
# and with it, cuBLAS picks reproducible reductions at no measurable cost (PyTorch's reproducibility notes). A
# value the user set is kept.
CUBLAS_WORKSPACE = ":4096:8"
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def seed_everything(seed: int, deterministic: bool) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # in case something removed it since import
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # set both ways: a warm rank's earlier trial may have turned it on
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # Deterministic mode also fills every new tensor's memory (NaN) in case an op reads it uninitialized; none of
    # ours does, and the fill cost 2% of a CPU step (MiniLM, 3 interleaved rounds), more on a GPU's allocations.
    torch.utils.deterministic.fill_uninitialized_memory = False
