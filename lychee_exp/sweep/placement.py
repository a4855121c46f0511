"""How a sweep places its trials. The sweeper's loop drives one small interface (Placement): `place` hands it
trials (asked and set up), `ended` gives back those that ended (waiting up to a timeout). `choose` picks it once,
before the first trial:

  InProcess       n_jobs 1, or Hydra's basic launcher (it runs jobs in this process, one after another): the job
                  runs in the main thread (it may install signal handlers, change directory); a lychee_exp job's
                  DDP ranks then serve the next trial (job.context.trials_run_here, launch.warm_ranks).
  LauncherSlots   hydra-submitit-launcher (submitit_local, submitit_slurm, slurm, slurm_local): every trial is its
                  own `launcher.launch([job])` call in its own thread; each call is a separate submitit job, so up
                  to n_jobs run at once and a slot is refilled as soon as its trial ends.
  LauncherBatches any other launcher (joblib, ray, ...): up to n_jobs trials in one `launcher.launch(batch)` call,
                  which runs them at once; the next batch waits for the slowest trial (these launchers are not
                  known to be safe to call from several threads at once).
  DeviceSlots     `hydra.sweeper.devices_per_trial` N (or auto's choice) below D, the devices one trial uses on
                  `all` (the default; for a lychee_exp job the device plan of its `parallel` and `gpus`, CPU ranks
                  one per core without CUDA; for another app every visible GPU, else every core): floor(D / N) slot
                  workers, all in the same study; this worker asks no trial.

A slot is a worker process of its own: the sweep's command line with the study's storage, name and directory
pinned and the slot's share of the devices (CUDA_VISIBLE_DEVICES on GPUs, with an equal share of the cores for its
ranks' threads; on CPU its own cores by affinity, so that the job plans one rank per core in that share). As an
ordinary worker of the study (claims with heartbeats, pruning, failures, resume: lychee_exp.sweep.storage) it takes
the study's next trial as soon as its own ends and keeps its own warm ranks, and a killed sweep is finished by the
same command. Processes, not threads: a Hydra job changes the working directory, logging and Hydra's global state.

`auto` picks N from measured scaling. With speedup s(n) of a trial's training on n devices over one device, D
devices and T trials still to run, each of single-device time t, slots of n devices finish the sweep in about

    wall(n) = ceil(T / floor(D / n)) * t / s(n)

and auto picks the n with the least wall(n) (a tie goes to the larger n: fewer trials in flight, less memory).
s(n) is measured for this sweep's own training settings, a short calibration run per candidate n (training only),
each cached in `scaling.json` beside the speedup baselines, keyed by every setting that changes a step's speed, the
device and n. torch and the run's schema are imported only where devices are split or measured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from omegaconf import DictConfig, OmegaConf

from lychee_exp.errors import STOP_SIGNALS, UserError
from lychee_exp.io.atomic import read_json, update_json_locked
from lychee_exp.launch.processes import die_with_parent
from lychee_exp.sweep import storage as st
from lychee_exp.sweep.outcome import Outcome
from lychee_exp.sweep.space import render
from lychee_exp.sweep.trials import PLACEMENT, Pending, TrialRunner

if TYPE_CHECKING:
    from lychee_exp.config.schema import RunConfig

log = logging.getLogger(__name__)
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
SUBMITIT = "hydra_plugins.hydra_submitit_launcher."
SLOT_ENV = "LYCHEE_SWEEP_SLOT"  # set in a slot's worker: it runs trials itself and starts no slots
WORKER_ENV = "LYCHEE_SWEEP_WORKER"  # shifts the sampler's seed, so that workers do not draw the same params
CALIBRATION_STEPS = 6  # after 2 warm-up steps: a few seconds per candidate on CPU ranks


class Placement(Protocol):
    room: int  # trials this worker may have in flight at once (0: it asks none)
    busy: int  # trials placed and not yet given back by `ended`
    finished: bool  # no trial will be placed or end here any more (the study may still lack trials)

    def place(self, batch: Sequence[Pending]) -> None: ...

    def ended(self, timeout: float) -> list[Pending]: ...

    def summary(self, ran: int) -> str: ...


class SlotsFailed(RuntimeError):
    """A slot worker was killed or crashed (not a trial's failure, which the study's counts report)."""


def choose(
    runner: TrialRunner, n_jobs: int, devices_per_trial: Any, job_cfg: DictConfig, n_trials: int, sample: Sequence[str]
) -> Placement:
    """Device slots when devices_per_trial asks for them (its decision recorded on the study), else this worker
    through Hydra's launcher. job_cfg: the sample trial's config, composed from the `sample` overrides."""
    setting = parse(devices_per_trial)
    if setting == "all" or SLOT_ENV in os.environ:
        return launcher_placement(runner, n_jobs)
    study, sweep_dir = runner.settings.study, runner.settings.sweep_dir
    devices = machine_devices()
    run = _run_config(job_cfg) if runner.settings.lychee else None
    total = trial_devices(run, devices)
    if setting == "auto":
        if run is None:
            raise UserError(
                "hydra.sweeper.devices_per_trial=auto measures lychee_exp training; for this app give a number"
            )
        finished = sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished() and st.counts(t))
        decision = _auto(run, sample, sweep_dir, devices, total, max(1, n_trials - finished))
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
        return launcher_placement(runner, n_jobs)
    slots = plan_slots(devices, total, per_trial)
    log.info(
        "devices_per_trial=%d: %d slot(s) at once (%s), each taking the study's next trial as its own ends",
        per_trial,
        len(slots),
        "; ".join(slot.describe() for slot in slots),
    )
    pinned = [
        f"hydra.sweep.dir={render(str(sweep_dir))}",
        f"hydra.sweeper.storage={render(runner.settings.storage_url)}",
        f"hydra.sweeper.study_name={render(study.study_name)}",
    ]
    return DeviceSlots(slots, slot_command([*pinned, *([f"gpus={per_trial}"] if run is not None else [])]))


def parse(value: Any) -> str | int:
    """devices_per_trial: all | auto | a positive int, else a one-line error naming the key."""
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


# ------------------------------------------------------------------------------- through Hydra's launcher
class _Queued:
    """Trials end into a queue: at once for the placements that run them in place, from threads for slots."""

    room, finished = 1, False

    def __init__(self, runner: TrialRunner, room: int = 1) -> None:
        self.runner, self.room, self.busy = runner, room, 0
        self._done: queue.Queue[Pending] = queue.Queue()

    def ended(self, timeout: float) -> list[Pending]:
        try:
            got = [self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait()]
        except queue.Empty:
            return []
        while not self._done.empty():
            got.append(self._done.get_nowait())
        self.busy -= len(got)
        return got

    def summary(self, ran: int) -> str:
        return f"this worker ran {ran}"


class InProcess(_Queued):
    def place(self, batch: Sequence[Pending]) -> None:
        for pending in batch:
            self.busy += 1
            self.runner.execute(pending)
            self._done.put(pending)


class LauncherBatches(_Queued):
    def place(self, batch: Sequence[Pending]) -> None:
        self.busy += len(batch)
        self.runner.execute_batch(batch)
        for pending in batch:
            self._done.put(pending)


class LauncherSlots(_Queued):
    def place(self, batch: Sequence[Pending]) -> None:
        for pending in batch:
            self.busy += 1
            threading.Thread(
                target=self._run, args=(pending,), name=f"trial-{pending.trial.number}", daemon=True
            ).start()

    def _run(self, pending: Pending) -> None:
        try:
            self.runner.execute(pending)
        except BaseException as err:  # noqa: BLE001 - the trial fails, the slot thread must still report
            pending.outcome = Outcome("FAIL", reason=f"crashed: {type(err).__name__}: {err}"[:500], kind="crashed")
        finally:
            self._done.put(pending)


def launch_mode(launcher: Any, n_jobs: int) -> str:
    """one | slots | batch (InProcess, LauncherSlots, LauncherBatches)."""
    names = [f"{c.__module__}.{c.__qualname__}" for c in type(launcher).__mro__]
    if n_jobs <= 1 or BASIC in names:
        return "one"
    if any(name.startswith(SUBMITIT) for name in names):
        return "slots"
    return "batch"


def launcher_placement(runner: TrialRunner, n_jobs: int) -> Placement:
    """Trials through Hydra's launcher, as it can run them (the plan logged in one line)."""
    launcher = runner.settings.launcher
    mode = launch_mode(launcher, n_jobs)
    plan = describe_plan(mode, n_jobs, type(launcher).__name__)
    if plan:
        log.info("%s", plan)
    if mode == "slots":
        return LauncherSlots(runner, n_jobs)
    return LauncherBatches(runner, n_jobs) if mode == "batch" else InProcess(runner)


def describe_plan(mode: str, n_jobs: int, launcher: str) -> str:
    """The one line saying how trials will run (nothing for one trial at a time by request)."""
    if mode == "slots":
        return (
            f"n_jobs={n_jobs}: up to {n_jobs} trials at once, each its own {launcher} job; a slot takes the "
            "next trial as soon as its trial ends"
        )
    if mode == "batch":
        return (
            f"n_jobs={n_jobs}: trials in batches of {n_jobs}, one {launcher} call each (a batch waits for its slowest)"
        )
    if n_jobs > 1:
        return (
            f"n_jobs={n_jobs}: {launcher} runs trials one at a time, in this process (concurrent trials: "
            "hydra/launcher=submitit_local, slurm, ..., or device slots: hydra.sweeper.devices_per_trial=1)"
        )
    return ""


# ------------------------------------------------------------------------------------------ device slots
class DeviceSlots:
    """Runs the slot workers on the first `ended` call and waits for them all: they ask, run and tell the trials."""

    room = 0

    def __init__(self, slots: Sequence[Slot], command: Sequence[str]) -> None:
        self.slots, self.command, self.busy, self.finished = list(slots), list(command), 1, False

    def place(self, batch: Sequence[Pending]) -> None:
        raise AssertionError("device slots ask their own trials")

    def ended(self, timeout: float) -> list[Pending]:
        if not self.finished:
            codes = run_slots(self.slots, self.command)
            self.busy, self.finished = 0, True
            failed = [(slot.index, code) for slot, code in zip(self.slots, codes) if code not in (0, 1)]
            if failed:  # exit 1 is the trials' failure, which the study's counts report
                raise SlotsFailed(
                    f"slot worker(s) ended abnormally (slot, exit code): {failed}; the same command resumes"
                )
        return []

    def summary(self, ran: int) -> str:
        return "run in device slots"


@dataclass(frozen=True)
class Devices:
    """What this machine can split: CUDA device ids (as CUDA_VISIBLE_DEVICES names them) or CPU core ids."""

    kind: str  # cuda | cpu
    ids: tuple[str, ...]


@dataclass(frozen=True)
class Slot:
    index: int
    kind: str
    ids: tuple[str, ...]
    cores: tuple[int, ...] = ()  # its CPU cores (on CPU its devices; with GPUs an equal share for its ranks' threads)

    def describe(self) -> str:
        return f"{'GPU' if self.kind == 'cuda' else 'CPU core'}s {','.join(self.ids)}"


def machine_devices(cuda_count: int | None = None) -> Devices:
    """The devices visible to this sweep: CUDA GPUs (the visible subset's own names), else the CPU cores of
    this process's affinity."""
    import torch

    count = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_count is None else cuda_count
    if count:
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        ids = visible[:count] if len(visible) >= count else [str(i) for i in range(count)]
        return Devices("cuda", tuple(ids))
    return Devices("cpu", tuple(str(c) for c in _cores()))


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


def trial_devices(run: RunConfig | None, devices: Devices) -> int:
    """D, the devices one trial uses on `all` (run: a lychee_exp trial's config, None for another app)."""
    if run is None:
        return len(devices.ids)
    from lychee_exp.parallel.devices import plan_devices

    cuda = len(devices.ids) if devices.kind == "cuda" else 0
    return plan_devices(run.parallel.strategy, run.gpus, cuda_count=cuda, cores=len(devices.ids)).num_devices


def plan_slots(devices: Devices, used: int, per_trial: int) -> list[Slot]:
    """floor(used / per_trial) disjoint shares of the first `used` devices (the ones a trial on `all` uses)."""
    ids, count = devices.ids[:used], used // per_trial
    cores = _cores()
    share = max(1, len(cores) // max(count, 1))
    slots = []
    for i in range(count):
        own = ids[i * per_trial : (i + 1) * per_trial]
        mine = tuple(int(c) for c in own) if devices.kind == "cpu" else tuple(cores[i * share : (i + 1) * share])
        slots.append(Slot(i, devices.kind, own, mine if devices.kind == "cpu" or len(cores) >= count else ()))
    return slots


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: numbered cores, no affinity
        return list(range(os.cpu_count() or 1))


def slot_env(slot: Slot, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    worker = int(env.get(WORKER_ENV, 0) or 0)
    env[SLOT_ENV] = str(slot.index)
    env[WORKER_ENV] = str(worker * 1000 + slot.index)  # several machines' workers, each with slots
    if slot.kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.ids)
    return env


def slot_preexec(slot: Slot, parent: int) -> Callable[[], None]:
    """Runs in a process started on the slot (its worker, or a calibration), before it starts: its cores (CPU),
    and death with the sweep that started it (a SIGKILLed sweep must not leave workers claiming trials)."""

    def prepare() -> None:
        if slot.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(slot.cores))
        die_with_parent(parent)

    return prepare


def run_slots(slots: Sequence[Slot], command: Sequence[str]) -> list[int]:
    """Starts one worker per slot (`command` plus the slot's environment), waits for all, and returns their exit
    codes. Ctrl-C and the stop signals (SIGTERM, SIGHUP, SIGQUIT) to the sweep are passed on to every slot, which
    end their trials as a worker does."""
    procs = [
        subprocess.Popen(list(command), env=slot_env(slot), preexec_fn=slot_preexec(slot, os.getpid()))  # noqa: PLW1509
        for slot in slots
    ]

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    stops = [sig for sig in (signal.SIGINT, *STOP_SIGNALS) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, forward) for sig in stops}
    try:
        return [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def slot_command(extra: Sequence[str]) -> list[str]:
    """This process's own command line (the sweep as the user started it) with `extra` overrides after it."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    return [sys.executable, *argv[1:], *extra]


# ------------------------------------------------------------------------------- auto: measured scaling
def wall_time(n: int, speedup: float, devices: int, trials: int) -> float:
    """wall(n) in units of t (one trial's single-device time)."""
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


def _auto(
    run: RunConfig, sample: Sequence[str], sweep_dir: Path, devices: Devices, total: int, remaining: int
) -> Decision:
    def measure(n: int) -> float:
        return calibrate(sample, plan_slots(devices, total, n)[0], sweep_dir / "calibration" / f"{n}_devices")

    return decide(measured_speedups(run, devices.kind, candidates(total), measure), total, remaining)


def cache_path(cfg: RunConfig) -> Path:
    """The scaling cache: one file beside the speedup baselines for every setting (the keys tell them apart)."""
    from lychee_exp.tracking.speedup import baseline_file

    return baseline_file().with_name("scaling.json")


def cache_key(cfg: RunConfig, device_type: str, n: int) -> str:
    """The model, a digest of every setting that changes a step's speed (as the speedup baselines'), the device, n."""
    import torch

    from lychee_exp.tracking.speedup import throughput_settings

    settings = json.dumps(throughput_settings(cfg, device_type), sort_keys=True, default=str)
    device = torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu core"
    return f"{cfg.model.name}|{hashlib.sha1(settings.encode()).hexdigest()[:12]}|{device}|n={n}"


def store_rate(cfg: RunConfig, device_type: str, n: int, samples_per_s: float, source: str) -> None:
    """One measured training throughput on n devices (a calibration, or the scaling benchmark's figure), written
    under the cache's lock: another sweep may add entries meanwhile."""
    entry = {"samples_per_s": samples_per_s, "source": source, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    update_json_locked(cache_path(cfg), lambda table: table.update({cache_key(cfg, device_type, n): entry}))


def measured_speedups(
    cfg: RunConfig, device_type: str, counts: Sequence[int], measure: Callable[[int], float]
) -> dict[int, float]:
    """s(n) for every n in counts (1 included): samples/s at n over samples/s at 1, each from the cache (filled
    by earlier calibrations and by `python -m benchmarks`) or `measure(n)` (then cached)."""
    path, rates = cache_path(cfg), {}
    for n in sorted({1, *counts}):
        entry = read_json(path).get(cache_key(cfg, device_type, n))
        if entry:
            rates[n] = float(entry["samples_per_s"])
            source, when = entry.get("source", "?"), entry["measured_at"]
            log.info("auto: %d device(s): %.3g samples/s from %s (%s, %s)", n, rates[n], path, source, when)
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
    command = [sys.executable, "-m", "lychee_exp.run", *overrides, f"gpus={n}"]
    command += [f"trainer.max_steps={CALIBRATION_STEPS + 2}", "trainer.evaluate=false", "trainer.save_model=false"]
    command += ["trainer.checkpoint_every=0", "trainer.progress_bar=false", "logger=csv"]
    command += ["trainer.measure_speedup=false", f"hydra.run.dir={run_dir}"]
    env = {**slot_env(slot), "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=slot_preexec(slot, os.getpid()),  # noqa: PLW1509
    )
    metrics = read_json(run_dir / "metrics.json")
    if proc.returncode != 0 or not metrics:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"hydra.sweeper.devices_per_trial=auto: the calibration on {n} device(s) failed: {tail}")
    return float(metrics["train_samples_per_s"])
