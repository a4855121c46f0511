"""Observed speedup: a run's training throughput over ONE device's, measured, never assumed.

The single-device figure must match the run in everything but the device count: model, sequence lengths,
group size, per-device batch, precision, device type and CPU threads per rank. It comes from the cache
(`speedup.baseline_file`, JSON keyed by those settings; written by every single-device run and calibration,
readable, safe to delete), or, when absent, from a short calibration on one device before training.
`throughput.speedup_facts` turns it into the run's speedup.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from lychee_exp.core.atomic import write_json_atomic
from lychee_exp.core.config import RunConfig
from lychee_exp.core.devices import DevicePlan, resolve_precision, torch_device

log = logging.getLogger(__name__)


def baseline_key(cfg: RunConfig, plan: DevicePlan) -> str:
    m, p = cfg.model, cfg.model.prompt
    device = torch.cuda.get_device_name(0) if plan.device_type == "cuda" else f"cpu x{plan.threads_per_rank} threads"
    parts = [
        m.name,
        m.path,
        m.kind,
        f"lora{m.lora.r if m.lora.enabled else 0}",
        f"gc{m.gradient_checkpointing if m.gradient_checkpointing == 'auto' else int(m.gradient_checkpointing)}",
        f"q{p.query_max_len}",
        f"d{p.doc_max_len}",
        f"group{cfg.data.train_group_size}",
        f"batch{cfg.data.batch_size}",
        resolve_precision(cfg.trainer.precision, torch_device(plan.device_type)),
        device,
    ]
    return "|".join(str(part) for part in parts)


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cached_baseline(cfg: RunConfig, plan: DevicePlan) -> float | None:
    entry = _load(Path(cfg.speedup.baseline_file)).get(baseline_key(cfg, plan))
    return float(entry["samples_per_s"]) if entry else None


def store_baseline(cfg: RunConfig, plan: DevicePlan, samples_per_s: float, source: str) -> None:
    if samples_per_s <= 0:
        return
    path = Path(cfg.speedup.baseline_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = _load(path)
    table[baseline_key(cfg, plan)] = {
        "samples_per_s": samples_per_s,
        "source": source,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_json_atomic(path, table)


def single_device_plan(plan: DevicePlan) -> DevicePlan:
    return dataclasses.replace(plan, strategy="single", num_devices=1)


def calibration_config(cfg: RunConfig) -> RunConfig:
    """The run's config cut to warm-up + `calibration_steps` timed steps: no evaluation, saving or logging."""
    trainer = dataclasses.replace(
        cfg.trainer,
        max_steps=cfg.speedup.calibration_steps + 2,
        evaluate=False,
        save_model=False,
        checkpoint_every=0,
        resume="never",
        progress_bar=False,
    )
    return dataclasses.replace(cfg, trainer=trainer, logger=dataclasses.replace(cfg.logger, name="none"))


def resolve_baseline(cfg: RunConfig, plan: DevicePlan, train: Callable[[RunConfig, DevicePlan], dict]) -> float:
    """Single-device samples/s for this run's setting (0 = the run itself will be the baseline). Without a
    cached figure a multi-device run calibrates: `train` (the launcher's in-process runner) trains on one
    device for a few steps."""
    if cfg.speedup.baseline_samples_per_s > 0:
        return cfg.speedup.baseline_samples_per_s
    cached = cached_baseline(cfg, plan)
    if cached:
        return cached
    if plan.num_devices == 1 or not cfg.speedup.calibrate:
        return 0.0
    log.info(
        "speedup: no single-device baseline cached for this setting; timing %d steps on one device",
        cfg.speedup.calibration_steps,
    )
    value = train(calibration_config(cfg), single_device_plan(plan))["train_samples_per_s"]
    store_baseline(cfg, plan, value, "calibration")
    return value
