"""Observed speedup, the one home of its measurement: a run's train samples/s over ONE device's at the same
settings and per-device batch (one GPU; on CPU one rank with the run's threads per rank), and
scaling_efficiency = speedup / devices.

The one-device figure is a measured record (`Baseline`) keyed by throughput_settings and the device, cached in
`baseline_file()` (env LYCHEE_BASELINE_FILE; JSON, written under its lock, readable, safe to delete). Every
single-device run stores its own figure; a multi-device run without a cached one measures it in the first phase
of its launch (lychee_exp/train/baseline_phase.py). A figure measured while the machine was shared (on CPU: the
process got well under its threads' worth of CPU time), or a ratio above the device count, is not divided by:
the run records `speedup_status` saying why instead of a `speedup`. Only reliable figures are cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lychee_exp.config.auto import forward_chunk_count, packing_on, uses_fused
from lychee_exp.config.schema import RunConfig
from lychee_exp.io.atomic import read_json, update_json_locked
from lychee_exp.model.precision import resolve_precision
from lychee_exp.parallel.devices import DevicePlan, torch_device

log = logging.getLogger(__name__)

BASELINE_FILE_ENV = "LYCHEE_BASELINE_FILE"
DEFAULT_BASELINE_FILE = "outputs/throughput_baselines.json"
SHARED_CPU_SHARE = 0.75  # a CPU window with less of its threads' CPU time than this ran beside other work

# data keys that do not change a training step's speed (the rest of data, and all of model and loss, may)
_NOT_THROUGHPUT = ("name", "dev_file", "eval_batch_size", "max_dev_queries", "dev_split", "rerank_top_k")


def baseline_file() -> Path:
    return Path(os.environ.get(BASELINE_FILE_ENV) or DEFAULT_BASELINE_FILE)


def throughput_settings(cfg: RunConfig, device_type: str) -> dict:
    """Every setting that changes one device's samples/s, less the parallelism, with `auto`/null resolved for the
    device type (so that a default whose meaning changes does not reuse old figures): a baseline measured under
    other settings (another loss, forward chunks, bucketing...) must not be divided by. Not the accumulation:
    both figures count samples (queries), and one device's time per micro-batch does not depend on how many
    make an optimizer step, so the trials of a sweep over the global batch share one figure (only the optimizer
    step's share per sample shrinks as accumulation grows: small beside a micro-batch's forward and backward)."""
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in _NOT_THROUGHPUT}
    # data.packing=auto as decided on this device type: the ranks' config holds the decision, the job's `auto`
    data["packing"] = packing_on(cfg, device_type, cfg.parallel.strategy)
    t = cfg.trainer
    return {
        "model": dataclasses.asdict(cfg.model),
        "data": data,
        "loss": dataclasses.asdict(cfg.loss),
        "optimizer": [cfg.optimizer.name, uses_fused(cfg.optimizer, {device_type})],
        "trainer": [
            forward_chunk_count(t.forward_chunks, device_type),
            resolve_precision(t.precision, torch_device(device_type)),
            t.deterministic,
        ],
        "torch": torch.__version__,
    }


def one_device_description(plan: DevicePlan) -> str:
    """What a speedup divides by, in words."""
    if plan.device_type == "cuda":
        return f"1 device (1 GPU, {torch.cuda.get_device_name(0)})"
    threads = plan.threads_per_rank
    return f"1 device (1 rank x {threads} thread{'s' if threads > 1 else ''}, CPU)"


def baseline_key(cfg: RunConfig, plan: DevicePlan) -> str:
    """Readable parts, a digest of all of throughput_settings, then the device (CPU: one rank's threads)."""
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


def cpu_share(cpu_s: float, wall_s: float, threads: int) -> float | None:
    """The process's CPU time over a window / what its threads could have used; None without a window."""
    return cpu_s / (wall_s * threads) if wall_s > 0 and threads > 0 else None


@dataclass(frozen=True)
class Baseline:
    """One device's training throughput at a run's settings, and how it was measured. cpu_share: None on GPUs
    (their steps leave the CPU waiting by design)."""

    samples_per_s: float
    source: str
    cpu_share: float | None = None
    measured_at: str = ""

    def unreliable_because(self) -> str | None:
        if self.samples_per_s <= 0:
            return "no one-device figure measured"
        if self.cpu_share is not None and self.cpu_share < SHARED_CPU_SHARE:
            return f"machine shared (baseline at {100 * self.cpu_share:.0f}% CPU)"
        return None


def cached_baseline(cfg: RunConfig, plan: DevicePlan) -> Baseline | None:
    """The cached reliable figure for one device of `plan` at cfg's settings, if any."""
    entry = read_json(baseline_file()).get(baseline_key(cfg, plan))
    if not entry:
        return None
    fields = {f.name for f in dataclasses.fields(Baseline)}
    baseline = Baseline(**{k: v for k, v in entry.items() if k in fields})
    if baseline.unreliable_because():
        return None
    # said once per run, so that a figure can be found and deleted
    log.info(
        "speedup: one-device baseline %.3g samples/s from %s, %s (%s)",
        baseline.samples_per_s,
        baseline.source,
        baseline.measured_at or "?",
        baseline_file(),
    )
    return baseline


def store_baseline(cfg: RunConfig, plan: DevicePlan, baseline: Baseline) -> bool:
    """Caches a reliable figure (True); an unreliable one is only reported."""
    reason = baseline.unreliable_because()
    if reason:
        log.info("speedup: one-device figure from %s not cached: %s", baseline.source, reason)
        return False
    entry = dataclasses.asdict(dataclasses.replace(baseline, measured_at=time.strftime("%Y-%m-%d %H:%M:%S")))
    # several runs (concurrent trials, sweep workers) may end together: read-change-write under the file's lock
    update_json_locked(baseline_file(), lambda table: table.update({baseline_key(cfg, plan): entry}))
    return True


def speedup_facts(
    samples_per_s: float,
    baseline: Baseline | None,
    devices: int,
    plan: DevicePlan,
    missing: str = "trainer.measure_speedup=false",
) -> dict:
    """The run's speedup figures: `speedup` and `scaling_efficiency` when the baseline is reliable and the
    ratio possible, else none of them and `speedup_status` saying why. `devices`: every device of the run;
    `missing`: why there is no baseline, when there is none."""
    if baseline is None:
        return {"speedup_status": f"unmeasured: no one-device baseline ({missing})"}
    facts = {"baseline_samples_per_s": baseline.samples_per_s, "speedup_baseline": one_device_description(plan)}
    if baseline.cpu_share is not None:
        facts["baseline_cpu_share"] = baseline.cpu_share
    reason = baseline.unreliable_because()
    ratio = samples_per_s / baseline.samples_per_s if not reason else 0.0
    if not reason and ratio > devices:  # n devices cannot do more than n devices' work
        reason = f"impossible ratio ({ratio:.2f}x on {devices} device(s)): a timing was disturbed"
    if reason:
        return {**facts, "speedup_status": f"unreliable: {reason}"}
    return {**facts, "speedup": ratio, "scaling_efficiency": ratio / devices, "speedup_status": "measured"}


def speedup_note(metrics: dict) -> str:
    """The console summary's speedup part: one ratio, or why there is none."""
    if "speedup" in metrics:
        return f"; speedup {metrics['speedup']:.2f}x over {metrics['speedup_baseline']}"
    status = metrics.get("speedup_status")
    return f"; no speedup ({status})" if status else ""
