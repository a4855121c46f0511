"""What the DDP tests share (test_ddp, test_ddp_resume, test_ddp_devices): the tiny Lychee path on CPU ranks,
a run's losses and weights, and the CLI as a subprocess."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import TINY_RANKS
from safetensors.torch import load_file

# Tiny Lychee path, fp32, no dropout: one process with batch 2b and 2 ranks with batch b must agree.
TINY_DDP = [
    *TINY_RANKS,
    "optimizer.lr=1e-3",
    # no speedup baseline phase: these runs compare training, not throughput
    "trainer.measure_speedup=false",
]


def run_losses(run_dir: Path, key: str = "train/loss") -> list[float]:
    with (run_dir / "metrics.csv").open() as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


def run_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def start_cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


def live_processes_in_group(pgid: int) -> list[str]:
    """The processes of a process group that still run (an exited one may wait as a zombie for its reaper)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(stat.parent.name)
    return live
