"""`hydra.sweeper.devices_per_trial` in the sweep that the user started: `all` runs the trials here, each across
every device; N (or `auto`'s choice) places them in floor(D / N) slot workers (lychee_exp.sweep.slots, the
DeviceSlots placement) on the study this sweep has opened. D is what one trial uses on `all`: for a lychee_exp
job the device plan of its `parallel` and `gpus` (CPU ranks, one per core, without CUDA); for another app every
visible GPU, else every core.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from omegaconf import DictConfig, OmegaConf

from lychee_exp.errors import UserError
from lychee_exp.sweep import storage as st
from lychee_exp.sweep.dispatch import DeviceSlots
from lychee_exp.sweep.slots import SLOT_ENV, Devices, machine_devices, plan_slots, slot_command
from lychee_exp.sweep.space import render
from lychee_exp.sweep.trials import PLACEMENT

if TYPE_CHECKING:  # the run's config and the placement measurement import torch: only a sweep in slots needs them
    from lychee_exp.config.schema import RunConfig
    from lychee_exp.sweep.placement import Decision

log = logging.getLogger(__name__)


def parse(value: Any) -> str | int:
    """all | auto | a positive int, else a one-line error naming the key."""
    text = str(value).strip().lower()
    if text in ("all", "auto"):
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise UserError(f"hydra.sweeper.devices_per_trial={value}: use all, auto or a positive number of devices")
    return count


def in_slot() -> bool:
    return SLOT_ENV in os.environ


def _run_config(job_cfg: DictConfig) -> RunConfig:
    """The trial's RunConfig for planning: `${hydra:...}` values (the run's directories) resolve only inside a
    running job, and no figure planned here depends on them, so they are left empty."""
    from lychee_exp.config.schema import to_run_config

    def unhydra(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: unhydra(v) for k, v in node.items()}
        if isinstance(node, list):
            return [unhydra(v) for v in node]
        return "" if isinstance(node, str) and "${hydra" in node else node

    plain = OmegaConf.to_container(job_cfg, resolve=False)
    plain.pop("hydra", None)
    return to_run_config(unhydra(plain))


def trial_devices(job_cfg: DictConfig | None, devices: Devices) -> int:
    """D: the devices a trial uses on `all`."""
    if job_cfg is None:
        return len(devices.ids)
    from lychee_exp.parallel.devices import plan_devices

    run = _run_config(job_cfg)
    cuda = len(devices.ids) if devices.kind == "cuda" else 0
    return plan_devices(run.parallel.strategy, run.gpus, cuda_count=cuda, cores=len(devices.ids)).num_devices


def device_slots(
    setting: str | int,
    job_cfg: DictConfig | None,
    study: Any,
    n_trials: int,
    sample_overrides: Sequence[str],
    sweep_dir: Path,
    storage_url: str,
) -> DeviceSlots | None:
    """The slot workers that devices_per_trial (`parse`d) asks for; None: run the trials here, as one worker.
    job_cfg: the sample trial's config for a lychee_exp job, None for another app; sample_overrides make it."""
    if setting == "all" or in_slot():
        return None
    lychee, devices = job_cfg is not None, machine_devices()
    total = trial_devices(job_cfg, devices)
    if setting == "auto":
        if not lychee:
            raise UserError(
                "hydra.sweeper.devices_per_trial=auto measures lychee_exp training; for this app give a number"
            )
        finished = sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished() and st.counts(t))
        decision = _auto(job_cfg, sample_overrides, sweep_dir, devices, total, max(1, n_trials - finished))
        log.info("%s", decision.line())
        study.set_user_attr(PLACEMENT, {**decision.record(), "setting": "auto"})
        per_trial = decision.devices_per_trial
    else:
        per_trial = int(setting)
        if per_trial > total:
            raise UserError(f"hydra.sweeper.devices_per_trial={per_trial}, but a trial has {total} device(s) here")
        study.set_user_attr(
            PLACEMENT, {"setting": per_trial, "devices_per_trial": per_trial, "slots": total // per_trial}
        )
    if per_trial == total:
        log.info("devices_per_trial=%d: every trial on all %d device(s), one at a time", per_trial, total)
        return None
    slots = plan_slots(devices, total, per_trial)
    log.info(
        "devices_per_trial=%d: %d slot(s) at once (%s), each taking the study's next trial as its own ends",
        per_trial,
        len(slots),
        "; ".join(slot.describe() for slot in slots),
    )
    pinned = [
        f"hydra.sweep.dir={render(str(sweep_dir))}",
        f"hydra.sweeper.storage={render(storage_url)}",
        f"hydra.sweeper.study_name={render(study.study_name)}",
    ]
    return DeviceSlots(slots, slot_command([*pinned, *([f"gpus={per_trial}"] if lychee else [])]))


def _auto(
    job_cfg: DictConfig, sample_overrides: Sequence[str], sweep_dir: Path, devices: Devices, total: int, remaining: int
) -> Decision:
    from lychee_exp.sweep import placement

    run = _run_config(job_cfg)

    def measure(n: int) -> float:
        slot = plan_slots(devices, total, n)[0]
        return placement.calibrate(sample_overrides, slot, sweep_dir / "calibration" / f"{n}_devices")

    counts = placement.candidates(total)
    speedups = placement.measured_speedups(run, devices.kind, counts, measure)
    return placement.decide(speedups, total, remaining)
