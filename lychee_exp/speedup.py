"""Observed speedup: a run's training throughput over ONE device's, measured, never assumed.

The single-device figure must match the run in everything but the device count: model, sequence lengths,
group size, per-device batch, precision, device type and CPU threads per rank. It comes from the cache
(`speedup.baseline_file`, JSON keyed by those settings; written by every single-device run and calibration,
readable, safe to delete), or, when absent, from a short calibration on one device before training.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch

from lychee_exp.config import RunConfig
from lychee_exp.devices import DevicePlan, resolve_precision

log = logging.getLogger(__name__)


def baseline_key(cfg: RunConfig, plan: DevicePlan) -> str:
    m, p = cfg.model, cfg.model.prompt
    device = torch.cuda.get_device_name(0) if plan.device_type == "cuda" else f"cpu x{plan.threads_per_rank} threads"
    parts = [m.name, m.path, m.kind, f"lora{m.lora.r if m.lora.enabled else 0}", f"gc{int(m.gradient_checkpointing)}",
             f"q{p.query_max_len}", f"d{p.doc_max_len}", f"group{cfg.data.train_group_size}",
             f"batch{cfg.data.batch_size}", resolve_precision(cfg.trainer.precision, torch.device(plan.device_type)),
             device]
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
    table[baseline_key(cfg, plan)] = {"samples_per_s": samples_per_s, "source": source,
                                      "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def single_device_plan(plan: DevicePlan) -> DevicePlan:
    return dataclasses.replace(plan, strategy="single", num_devices=1)


def calibrate(cfg: RunConfig, plan: DevicePlan, output_dir: Path) -> float:
    """Times warm-up + `calibration_steps` training steps on one device of the run's kind, in this process."""
    from lychee_exp.distributed import DistEnv
    from lychee_exp.train import run_training

    steps = cfg.speedup.calibration_steps
    log.info("speedup: no single-device baseline cached for this setting; timing %d steps on one device", steps)
    calibration = dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(cfg.trainer, max_steps=steps + 2, evaluate=False, save_model=False,
                                    checkpoint_every=0, resume="never", progress_bar=False),
        logger=dataclasses.replace(cfg.logger, name="none"))
    threads = torch.get_num_threads()
    if plan.device_type == "cpu":
        torch.set_num_threads(plan.threads_per_rank)
    try:
        device = torch.device("cuda", 0) if plan.device_type == "cuda" else torch.device("cpu")
        metrics = run_training(calibration, DistEnv(device=device), single_device_plan(plan), output_dir)
    finally:
        torch.set_num_threads(threads)
        if plan.device_type == "cuda":
            torch.cuda.empty_cache()
    return metrics["train_samples_per_s"]


def resolve_baseline(cfg: RunConfig, plan: DevicePlan, output_dir: Path) -> float:
    """Single-device samples/s for this run's setting (0 = the run itself will be the baseline)."""
    if cfg.speedup.baseline_samples_per_s > 0:
        return cfg.speedup.baseline_samples_per_s
    cached = cached_baseline(cfg, plan)
    if cached:
        return cached
    if plan.num_devices == 1 or not cfg.speedup.calibrate:
        return 0.0
    value = calibrate(cfg, plan, output_dir)
    store_baseline(cfg, plan, value, "calibration")
    return value


def baseline_description(plan: DevicePlan) -> str:
    """What `speedup` divides by, in words: on CPU one rank with the run's threads per rank, which is not one
    process using every core (on a 2-core machine that one is as fast as 2 ranks x 1 thread)."""
    if plan.device_type == "cuda":
        return f"1 GPU ({torch.cuda.get_device_name(0)})"
    threads = plan.threads_per_rank
    return f"1 rank x {threads} thread{'s' if threads > 1 else ''} (CPU)"


def speedup_facts(samples_per_s: float, baseline: float, num_devices: int, baseline_name: str = "") -> dict:
    """speedup = samples/s / baseline; a single-device run without a baseline is its own (speedup 1)."""
    if baseline <= 0:
        baseline = samples_per_s if num_devices == 1 else 0.0
    speedup = samples_per_s / baseline if baseline > 0 else float("nan")
    return {"baseline_samples_per_s": baseline, "speedup": speedup, "scaling_efficiency": speedup / num_devices,
            "speedup_baseline": baseline_name if baseline > 0 else "none measured"}
