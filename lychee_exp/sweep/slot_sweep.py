"""`hydra.sweeper.devices_per_trial` in the sweep that the user started: `all` runs the trials here, each across
every device; N (or `auto`'s choice) starts floor(D / N) slot workers (lychee_exp.sweep.slots) on the study
this sweep has opened and waits for them. D is what one trial uses on `all`: for a lychee_exp job the device
plan of its `parallel` and `gpus` (CPU ranks, one per core, without CUDA); for another app every visible GPU,
else every core.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lychee_exp.core.errors import UserError
from lychee_exp.sweep import storage as st
from lychee_exp.sweep.slots import SLOT_ENV, Devices, machine_devices, plan_slots, run_slots, slot_command
from lychee_exp.sweep.space import render

if TYPE_CHECKING:  # the run's config and the placement measurement import torch: only a sweep in slots needs them
    from lychee_exp.core.config import RunConfig
    from lychee_exp.sweep.placement import Decision

log = logging.getLogger(__name__)
PLACEMENT = "placement"  # study attribute: the decision and its figures (results, and each trial's W&B config)


class SlotsFailed(RuntimeError):
    """A slot worker was killed or crashed (not a trial's failure, which the study's counts report)."""


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
    from lychee_exp.core.config import to_run_config

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
    from lychee_exp.core.devices import plan_devices

    run = _run_config(job_cfg)
    cuda = len(devices.ids) if devices.kind == "cuda" else 0
    return plan_devices(run.parallel.strategy, run.gpus, cuda_count=cuda, cores=len(devices.ids)).num_devices


def start(sw: Any, job_cfg: DictConfig) -> bool:
    """Runs the sweep in slots when devices_per_trial asks for them; False: run it here, as one worker."""
    setting = parse(sw.devices_per_trial)
    if setting == "all" or in_slot():
        return False
    devices = machine_devices()
    total = trial_devices(job_cfg if sw.lychee else None, devices)
    if setting == "auto":
        if not sw.lychee:
            raise UserError(
                "hydra.sweeper.devices_per_trial=auto measures lychee_exp training; for this app give a number"
            )
        decision = _auto(sw, job_cfg, devices, total)
        log.info("%s", decision.line())
        sw.study.set_user_attr(PLACEMENT, {**decision.record(), "setting": "auto"})
        per_trial = decision.devices_per_trial
    else:
        per_trial = setting
        if per_trial > total:
            raise UserError(f"hydra.sweeper.devices_per_trial={per_trial}, but a trial has {total} device(s) here")
        sw.study.set_user_attr(
            PLACEMENT, {"setting": per_trial, "devices_per_trial": per_trial, "slots": total // per_trial}
        )
    if per_trial == total:
        log.info("devices_per_trial=%d: every trial on all %d device(s), one at a time", per_trial, total)
        return False
    slots = plan_slots(devices, total, per_trial)
    log.info(
        "devices_per_trial=%d: %d slot(s) at once (%s), each taking the study's next trial as its own ends",
        per_trial,
        len(slots),
        "; ".join(slot.describe() for slot in slots),
    )
    pinned = [
        f"hydra.sweep.dir={render(str(sw.sweep_dir))}",
        f"hydra.sweeper.storage={render(sw.url)}",
        f"hydra.sweeper.study_name={render(sw.study.study_name)}",
    ]
    codes = run_slots(slots, slot_command([*pinned, *([f"gpus={per_trial}"] if sw.lychee else [])]))
    failed = [(slot.index, code) for slot, code in zip(slots, codes) if code not in (0, 1)]
    if failed:  # exit 1 is the trials' failure, which the study's counts report below
        raise SlotsFailed(f"slot worker(s) ended abnormally (slot, exit code): {failed}; the same command resumes")
    return True


def _auto(sw: Any, job_cfg: DictConfig, devices: Devices, total: int) -> Decision:
    from lychee_exp.sweep import placement

    run = _run_config(job_cfg)
    finished = sum(1 for t in sw.study.get_trials(deepcopy=False) if t.state.is_finished() and st.counts(t))
    remaining = max(1, sw.n_trials - finished)
    overrides = sw.space.overrides(sw.sample_params)

    def measure(n: int) -> float:
        slot = plan_slots(devices, total, n)[0]
        return placement.calibrate(overrides, slot, sw.sweep_dir / "calibration" / f"{n}_devices")

    counts = placement.candidates(total)
    speedups = placement.measured_speedups(run, devices.kind, counts, measure)
    return placement.decide(speedups, total, remaining)


def record_line(sw: Any) -> str:
    """`++trial.placement=...` for a lychee_exp trial (it lands in the trial's config, W&B's included)."""
    decided = sw.study.user_attrs.get(PLACEMENT)
    return f"++trial.placement={render(decided)}" if decided else ""
