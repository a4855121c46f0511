"""Observed speedup: a run's training throughput over a single process's on the same hardware, measured, never
assumed. Two baselines, each matching the run in everything but the parallelism (model, sequence lengths, group
size, per-device batch, precision, device type):
- the best single process (`speedup`): on GPUs one GPU; on CPU ONE process with all the run's threads
  (ranks x threads per rank), what a user would otherwise run on those cores;
- one rank (`speedup_vs_one_rank`): one device, or on CPU one process with one rank's threads (the per-device
  figure behind `scaling_efficiency`). On GPUs the two are the same run.
Each comes from `speedup.*_samples_per_s` when given, else the cache (`speedup.baseline_file`, JSON keyed by the
settings and thread count; written by every single-process run and calibration, readable, safe to delete), else
a short calibration before training. `throughput.speedup_facts` turns them into the run's figures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from lychee_exp.core.atomic import read_json, update_json_locked
from lychee_exp.core.chunks import forward_chunk_count
from lychee_exp.core.config import RunConfig
from lychee_exp.core.devices import DevicePlan, resolve_precision, torch_device
from lychee_exp.core.optim import uses_fused

log = logging.getLogger(__name__)


# data keys that do not change a training step's speed (the rest of data, and all of model and loss, may)
_NOT_THROUGHPUT = ("name", "dev_file", "eval_batch_size", "max_dev_queries", "dev_split", "rerank_top_k")


def throughput_settings(cfg: RunConfig, device_type: str) -> dict:
    """Every setting that changes the speed of a training step, less the parallelism, with `auto`/null resolved
    for the device type (so that a default whose meaning changes does not reuse old figures): a baseline measured
    under other settings (another loss, forward chunks, bucketing, accumulation...) must not be divided by."""
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in _NOT_THROUGHPUT}
    t = cfg.trainer
    return {
        "model": dataclasses.asdict(cfg.model),
        "data": data,
        "loss": dataclasses.asdict(cfg.loss),
        "optimizer": [cfg.optimizer.name, uses_fused(cfg.optimizer, {device_type})],
        "trainer": [
            t.grad_accum_steps,
            forward_chunk_count(t.forward_chunks, device_type),
            resolve_precision(t.precision, torch_device(device_type)),
            t.deterministic,
        ],
        "torch": torch.__version__,
    }


def baseline_key(cfg: RunConfig, plan: DevicePlan) -> str:
    """The settings a single-process figure was measured at; `plan`: that single process (its threads). Readable
    parts, a digest of all of throughput_settings, then the device."""
    m, p = cfg.model, cfg.model.prompt
    settings = json.dumps(throughput_settings(cfg, plan.device_type), sort_keys=True, default=str)
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
        hashlib.sha1(settings.encode()).hexdigest()[:10],
        device,
    ]
    return "|".join(str(part) for part in parts)


def cached_baseline(cfg: RunConfig, plan: DevicePlan) -> float | None:
    entry = read_json(Path(cfg.speedup.baseline_file)).get(baseline_key(cfg, plan))
    if not entry:
        return None
    # said once per run, so that a figure measured on a busy machine can be found and deleted
    log.info(
        "speedup: %d thread(s) per rank: baseline %.3g samples/s from %s, %s (%s)",
        plan.threads_per_rank,
        entry["samples_per_s"],
        entry.get("source", "?"),
        entry.get("measured_at", "?"),
        cfg.speedup.baseline_file,
    )
    return float(entry["samples_per_s"])


def store_baseline(cfg: RunConfig, plan: DevicePlan, samples_per_s: float, source: str) -> None:
    if samples_per_s <= 0:
        return
    entry = {"samples_per_s": samples_per_s, "source": source, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    # several runs (concurrent trials, sweep workers) may end together: read-change-write under the file's lock
    update_json_locked(Path(cfg.speedup.baseline_file), lambda table: table.update({baseline_key(cfg, plan): entry}))


def single_device_plan(plan: DevicePlan) -> DevicePlan:
    """One rank of the run: one device, with one rank's threads on CPU."""
    return dataclasses.replace(plan, strategy="single", num_devices=1)


def single_process_plan(plan: DevicePlan) -> DevicePlan:
    """The best single process on the run's hardware: one GPU, or on CPU one process with every thread the
    run's ranks use together."""
    one = single_device_plan(plan)
    if plan.device_type == "cuda":
        return one
    return dataclasses.replace(one, threads_per_rank=plan.num_devices * plan.threads_per_rank)


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


def resolve_baselines(
    cfg: RunConfig, plan: DevicePlan, train: Callable[[RunConfig, DevicePlan], dict]
) -> tuple[float, float]:
    """(best single process, one rank) samples/s for this run's setting; 0 = none (a single-process run is its
    own). Without a given or cached figure a multi-device run calibrates: `train` (the launcher's in-process
    runner) trains that single process for a few steps."""
    process_cfg = cfg
    if plan.device_type != "cuda" and plan.num_devices > 1:
        # on CPU the one process does the whole step's work: every rank's queries in one batch, so that both
        # sides train the same batches and only the parallel setup differs
        data = dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * plan.num_devices)
        process_cfg = dataclasses.replace(cfg, data=data)
        if cfg.data.max_tokens_per_batch:  # a token budget is per device: the ranks' micro-batches, accumulated
            accum = cfg.trainer.grad_accum_steps * plan.num_devices
            process_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, grad_accum_steps=accum))
    process = _baseline(process_cfg, plan, single_process_plan(plan), cfg.speedup.baseline_samples_per_s, train)
    rank_plan = single_device_plan(plan)
    if rank_plan == single_process_plan(plan):  # GPUs, or one CPU rank: the same single process
        return process, cfg.speedup.one_rank_samples_per_s or process
    return process, _baseline(cfg, plan, rank_plan, cfg.speedup.one_rank_samples_per_s, train)


def _baseline(cfg: RunConfig, plan: DevicePlan, single: DevicePlan, given: float, train: Callable) -> float:
    if given > 0:
        return given
    cached = cached_baseline(cfg, single)
    if cached:
        return cached
    if single == dataclasses.replace(plan, strategy="single") or not cfg.speedup.calibrate:
        return 0.0  # the run is that single process (its own baseline), or calibration is off
    log.info(
        "speedup: no baseline cached for one process with %d thread(s) per rank; timing %d steps",
        single.threads_per_rank,
        cfg.speedup.calibration_steps,
    )
    value = train(calibration_config(cfg), single)["train_samples_per_s"]
    store_baseline(cfg, single, value, "calibration")
    return value
