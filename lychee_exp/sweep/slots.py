"""Device slots (`hydra.sweeper.devices_per_trial: N`): floor(devices / N) trials at once on this machine, each
slot with its own devices, all in the same study.

Each slot is a worker process of its own: the same command line, with the study's storage, name and directory
pinned and the slot's share of the devices (CUDA_VISIBLE_DEVICES on GPUs, with an equal share of the cores for
its ranks' threads; on CPU its own cores by affinity, so that the job plans one rank per core in that share). A
slot process is an ordinary worker of the study (trials claimed with heartbeats, pruning, failures, resume:
lychee_exp.sweep.storage), so a slot takes the study's next trial as soon as its own ends, keeps its own warm
ranks, and a killed sweep is finished by the same command.
Slots are processes, not threads: a Hydra job changes the working directory, logging and Hydra's global state,
which two jobs in one process cannot share.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

from lychee_exp.errors import STOP_SIGNALS
from lychee_exp.launch.processes import die_with_parent

log = logging.getLogger(__name__)

SLOT_ENV = "LYCHEE_SWEEP_SLOT"  # set in a slot's worker: it runs trials itself and starts no slots
WORKER_ENV = "LYCHEE_SWEEP_WORKER"  # shifts the sampler's seed, so that workers do not draw the same params


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
    import torch  # here: the sweeper's start must not pay for torch unless it plans slots

    count = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_count is None else cuda_count
    if count:
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        ids = visible[:count] if len(visible) >= count else [str(i) for i in range(count)]
        return Devices("cuda", tuple(ids))
    return Devices("cpu", tuple(str(c) for c in _cores()))


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


def slot_preexec(slot: Slot, parent: int):
    """Runs in the slot's process before it starts: its cores (CPU), and death with the sweep that started
    it (a SIGKILLed sweep must not leave workers claiming trials)."""

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
