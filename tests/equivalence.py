"""What two runs that should train identically must agree on, read from their run directories: the loss AND the
pre-clip gradient norm of every logged step (metrics.csv), and the saved weights.

Losses alone cannot tell a gradient that is off by a constant factor: AdamW divides it out and clipping hides it.
The logged gradient norm is taken before clipping, so a factor shows in it at once (and SGD, clipping thresholds
and the logged figure itself all depend on it)."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from lychee_exp.tracking.keys import HISTORY


def step_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {loss, grad_norm} from a run's metrics.csv training rows."""
    rows: dict[int, dict[str, float]] = {}
    with (Path(run_dir) / "metrics.csv").open() as handle:
        for row in csv.DictReader(handle):
            if row.get(HISTORY["grad_norm"]):
                step = int(float(row["step"]))
                rows[step] = {"loss": float(row[HISTORY["loss"]]), "grad_norm": float(row[HISTORY["grad_norm"]])}
    return rows


def grad_norms(run_dir: Path) -> list[float]:
    rows = step_rows(run_dir)
    return [rows[step]["grad_norm"] for step in sorted(rows)]


def saved_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model" / "model.safetensors"))


def assert_same_training(run: Path, reference: Path, rtol: float = 1e-4, weights: bool = True) -> None:
    """Same steps, per-step loss and pre-clip gradient norm within rtol, and (weights=True) the same saved
    weights. Raises AssertionError naming the first difference."""
    got, want = step_rows(run), step_rows(reference)
    assert sorted(got) == sorted(want) and want, f"logged steps differ: {sorted(got)} vs {sorted(want)}"
    for step in sorted(want):
        for key in ("loss", "grad_norm"):
            a, b = got[step][key], want[step][key]
            assert abs(a - b) <= rtol * abs(b) + 1e-7, f"step {step} {key}: {a} vs {b} (ratio {a / b:.6g})"
    if weights:
        w_run, w_ref = saved_weights(run), saved_weights(reference)
        assert w_run.keys() == w_ref.keys()
        for name in w_ref:
            torch.testing.assert_close(w_run[name], w_ref[name], atol=1e-5, rtol=1e-4, msg=name)
