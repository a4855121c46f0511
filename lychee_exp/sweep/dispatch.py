"""Where a sweep's trials run, behind one small interface (Placement) that the sweeper's loop drives:
`place` hands it trials (asked and set up), `ended` gives back those that ended (waiting up to a timeout).

  InProcess       n_jobs 1, or Hydra's basic launcher (it runs jobs in this process, one after another): the job
                  runs in the main thread (it may install signal handlers, change directory).
  LauncherSlots   hydra-submitit-launcher (submitit_local, submitit_slurm, slurm, slurm_local): every trial is its
                  own `launcher.launch([job])` call in its own thread; each call is a separate submitit job, so up
                  to n_jobs run at once and a slot is refilled as soon as its trial ends.
  LauncherBatches any other launcher (joblib, ray, ...): up to n_jobs trials in one `launcher.launch(batch)` call,
                  which runs them at once; the next batch waits for the slowest trial (these launchers are not
                  known to be safe to call from several threads at once).
  DeviceSlots     hydra.sweeper.devices_per_trial=N: slot worker processes, each its own share of the devices and
                  an ordinary worker of the study (lychee_exp.sweep.device_slots); this worker asks no trial.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Protocol, Sequence

from lychee_exp.sweep.outcome import Outcome
from lychee_exp.sweep.slots import Slot, run_slots
from lychee_exp.sweep.trials import Pending, TrialRunner

log = logging.getLogger(__name__)
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
SUBMITIT = "hydra_plugins.hydra_submitit_launcher."


class Placement(Protocol):
    room: int  # trials this worker may have in flight at once (0: it asks none)
    busy: int  # trials placed and not yet given back by `ended`
    finished: bool  # no trial will be placed or end here any more (the study may still lack trials)

    def place(self, batch: Sequence[Pending]) -> None: ...

    def ended(self, timeout: float) -> list[Pending]: ...

    def summary(self, ran: int) -> str: ...


class SlotsFailed(RuntimeError):
    """A slot worker was killed or crashed (not a trial's failure, which the study's counts report)."""


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


def launch_mode(launcher: Any, n_jobs: int) -> str:
    """one | slots | batch (see the module's docstring)."""
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
