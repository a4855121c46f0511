"""`hydra.sweeper.devices_per_trial: auto`: how many devices each trial gets, from measured scaling.

With speedup s(n) of a trial's training on n devices over one device, D devices and T trials still to run, each
of single-device time t, slots of n devices finish the sweep in about

    wall(n) = ceil(T / floor(D / n)) * t / s(n)

and auto picks the n with the least wall(n) (a tie goes to the larger n: fewer trials in flight, less memory).
s(n) is measured for this sweep's own training settings: a short calibration run per candidate n (training
only, no evaluation or saving), each cached in `scaling.json` next to the speedup baselines
(lychee_exp.tracking.speedup.scaling_file), keyed by every setting that changes a step's speed, the device and n.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from lychee_exp.config.schema import RunConfig
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_json_atomic
from lychee_exp.sweep.slots import Slot, slot_env, slot_preexec
from lychee_exp.tracking.speedup import scaling_file, throughput_settings

log = logging.getLogger(__name__)
CALIBRATION_STEPS = 6  # after 2 warm-up steps: a few seconds per candidate on CPU ranks


def wall_time(n: int, speedup: float, devices: int, trials: int) -> float:
    """The formula above in units of t (one trial's single-device time)."""
    return math.ceil(trials / (devices // n)) / speedup


@dataclass(frozen=True)
class Decision:
    devices_per_trial: int
    slots: int
    speedups: dict[int, float]
    devices: int
    trials: int
    gain: float  # trials per hour over one trial at a time on every device

    def line(self) -> str:
        figures = ", ".join(f"{s:.2f}x at {n}" for n, s in sorted(self.speedups.items()))
        return (
            f"devices_per_trial={self.devices_per_trial}: {self.slots} slot(s); speedup {figures} -> "
            f"{self.gain:.2f}x the trials per hour of 1 x {self.devices} ({self.trials} trial(s) to run; "
            "wall ~ ceil(T / floor(D/n)) x t / s(n))"
        )

    def record(self) -> dict:
        return {
            "devices_per_trial": self.devices_per_trial,
            "slots": self.slots,
            "speedups": {str(n): round(s, 4) for n, s in sorted(self.speedups.items())},
            "devices": self.devices,
            "trials_to_run": self.trials,
            "gain_over_all_devices": round(self.gain, 4),
        }


def decide(speedups: dict[int, float], devices: int, trials: int) -> Decision:
    trials = max(trials, 1)
    walls = {n: wall_time(n, s, devices, trials) for n, s in speedups.items()}
    best = min(walls, key=lambda n: (walls[n], -n))
    every = walls.get(devices, walls[max(walls)])
    return Decision(best, devices // best, dict(speedups), devices, trials, every / walls[best])


def candidates(devices: int) -> list[int]:
    """The device counts that split D devices without idling any: the divisors of D."""
    return [n for n in range(1, devices + 1) if devices % n == 0]


# ------------------------------------------------------------------------------------------- measuring s(n)
def cache_key(cfg: RunConfig, device_type: str, device_name: str, n: int) -> str:
    settings = json.dumps(throughput_settings(cfg, device_type), sort_keys=True, default=str)
    return f"{cfg.model.name}|{hashlib.sha1(settings.encode()).hexdigest()[:12]}|{device_name}|n={n}"


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cache_path(cfg: RunConfig) -> Path:
    return scaling_file()


def device_name(device_type: str) -> str:
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return "cpu core"


def store_rate(cfg: RunConfig, device_type: str, n: int, samples_per_s: float, source: str) -> None:
    """One measured training throughput on n devices (a calibration, or the scaling benchmark's figure)."""
    path = cache_path(cfg)
    table = _load(path)  # re-read: another sweep may have added entries meanwhile
    table[cache_key(cfg, device_type, device_name(device_type), n)] = {
        "samples_per_s": samples_per_s,
        "source": source,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, table)


def measured_speedups(
    cfg: RunConfig, device_type: str, counts: Sequence[int], measure: Callable[[int], float]
) -> dict[int, float]:
    """s(n) for every n in counts (1 included): samples/s at n over samples/s at 1, each from the cache (filled
    by earlier calibrations and by `python -m benchmarks`) or `measure(n)` (then cached)."""
    path, rates = cache_path(cfg), {}
    for n in sorted({1, *counts}):
        entry = _load(path).get(cache_key(cfg, device_type, device_name(device_type), n))
        if entry:
            rates[n] = float(entry["samples_per_s"])
            log.info(
                "auto: %d device(s): %.3g samples/s from %s (%s, %s)",
                n,
                rates[n],
                path,
                entry.get("source", "?"),
                entry["measured_at"],
            )
            continue
        rates[n] = measure(n)
        log.info("auto: %d device(s): %.3g samples/s (calibrated)", n, rates[n])
        store_rate(cfg, device_type, n, rates[n], "sweep calibration")
    if rates[1] <= 0:
        raise UserError("hydra.sweeper.devices_per_trial=auto: the 1-device calibration measured no throughput")
    return {n: rate / rates[1] for n, rate in rates.items()}


def calibrate(overrides: Sequence[str], slot: Slot, run_dir: Path) -> float:
    """Trains the trial's settings on one slot's devices for a few steps in a process of its own and returns its
    training samples/s."""
    n = len(slot.ids)
    command = [
        sys.executable,
        "-m",
        "lychee_exp.run",
        *overrides,
        f"gpus={n}",
        f"trainer.max_steps={CALIBRATION_STEPS + 2}",
        "trainer.evaluate=false",
        "trainer.save_model=false",
        "trainer.checkpoint_every=0",
        "trainer.progress_bar=false",
        "logger=csv",
        "trainer.measure_speedup=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**slot_env(slot), "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=slot_preexec(slot, os.getpid()),  # noqa: PLW1509
    )
    metrics = _load(run_dir / "metrics.json")
    if proc.returncode != 0 or not metrics:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"hydra.sweeper.devices_per_trial=auto: the calibration on {n} device(s) failed: {tail}")
    return float(metrics["train_samples_per_s"])
