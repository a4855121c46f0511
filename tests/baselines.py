"""A one-device throughput record put in the speedup cache by hand, for tests and scripts that need a `speedup`
figure without timing one on a machine whose load they do not control."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from lychee_exp.config.schema import to_run_config
from lychee_exp.job.in_process import compose_job
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.tracking.speedup import Baseline, store_baseline
from lychee_exp.train.baseline_phase import one_device_plan


def seed_baseline(overrides: Sequence[str], run_dir: Path, samples_per_s: float) -> None:
    """Stores a reliable one-device figure for the job that `overrides` compose (in LYCHEE_BASELINE_FILE)."""
    cfg = to_run_config(compose_job(list(overrides), run_dir))
    plan = plan_devices(cfg.parallel.strategy, cfg.gpus, cpu_threads_per_rank=cfg.parallel.cpu_threads_per_rank)
    store_baseline(cfg, one_device_plan(plan), Baseline(samples_per_s, "seeded by a test", cpu_share=1.0))
