"""The study in its storage: opening it, heartbeats, resuming after a dead worker, and the trial budget.

n_trials is the study's total, shared by every worker and every invocation. A trial whose worker died (its
heartbeat stopped, or its process is gone from this machine) is failed with the reason and its params are
queued again; such "interrupted" trials, and "surplus" ones (asked by two workers for the last slot), do not
count, so the study ends with exactly n_trials finished trials.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.exceptions import DuplicatedStudyError, UpdateFinishedTrialError
from optuna.trial import TrialState

from lychee_exp.errors import UserError

log = logging.getLogger(__name__)

# user attributes the sweeper keeps on trials
REASON = "fail_reason"  # why a trial failed
INTERRUPTED = "interrupted"  # failed because its worker died; re-run as trial `retry_of`'s successor
SURPLUS = "surplus"  # asked when the budget was already taken by other workers; never ran
RETRY_OF = "retry_of"  # on a re-run: the number of the interrupted trial
WORKER = "worker"  # [machine, pid, process start time] of the worker running the trial
RUN_DIR = "run_dir"
METRICS = "metrics"  # the run's metrics.json facts (so results need no shared file system)


def default_url(sweep_dir: Path) -> str:
    return f"sqlite:///{(sweep_dir / 'optuna.db').resolve()}"


def open_study(storage: Any, name: str, directions: list[str], sampler: Any, pruner: Any) -> tuple[Any, bool]:
    """The study, and whether it existed (created by an earlier run or another worker)."""
    verbosity = optuna.logging.get_verbosity()
    # no "A new study created" / "Using an existing study" lines from optuna: the sweeper says which once the
    # study's checks have passed, so that a refused re-run is one line
    optuna.logging.set_verbosity(max(verbosity, optuna.logging.WARNING))
    try:  # what create_study(load_if_exists=True) does, telling which happened
        study = optuna.create_study(
            storage=storage, study_name=name, sampler=sampler, pruner=pruner, directions=directions
        )
        existing = False
    except DuplicatedStudyError:
        study, existing = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner), True
    finally:
        optuna.logging.set_verbosity(verbosity)
    stored = [d.name.lower() for d in study.directions]
    if stored != directions:
        raise UserError(
            f"hydra.sweeper.direction={directions}: study {name!r} in this storage has {stored}; "
            "use another study_name (or storage) for another objective"
        )
    return study, existing


def check_search_space(study: Any, distributions: dict[str, Any], custom: bool) -> None:
    """A study keeps the search space its trials were drawn from: a re-run (or another worker) asking another one
    is refused before it asks a trial. optuna itself refuses only a change of a parameter's kind, and only inside
    the first new trial (which it leaves RUNNING or FAIL in the study); a changed range, or parameters added or
    dropped, it mixes into one study whose sampler and results compare trials of different spaces. Naming the new
    study apart instead would hide the earlier trials and restart n_trials silently: the user chooses a name.
    `custom`: a custom_search_space suggests parameters of its own, so only the shared ones are compared."""
    stored: dict[str, Any] = {}
    drawn_whole = False  # a trial that drew all its parameters (a running one may be mid-draw)
    for trial in study.get_trials(deepcopy=False):
        for key, distribution in trial.distributions.items():
            stored.setdefault(key, distribution)
        drawn_whole = drawn_whole or trial.state in (TrialState.COMPLETE, TrialState.PRUNED)
    if not stored:
        return
    fix = "use another hydra.sweeper.study_name (or storage) for another search space"
    for key, ours in distributions.items():
        if key in stored and stored[key] != ours:
            raise UserError(
                f"search space: {key} is {_shown(ours)} here, but study {study.study_name!r} drew it from "
                f"{_shown(stored[key])}; {fix}"
            )
    # another worker's trial being drawn right now holds only some of its parameters: not an "added" one
    added = sorted(set(distributions) - set(stored)) if drawn_whole else []
    dropped = sorted(set(stored) - set(distributions))
    if not custom and (added or dropped):
        change = "; ".join(f"{what} {', '.join(keys)}" for what, keys in (("adds", added), ("drops", dropped)) if keys)
        raise UserError(
            f"search space: this sweep {change}, against the {len(stored)} parameter(s) of study "
            f"{study.study_name!r} ({', '.join(sorted(stored))}); {fix}"
        )


def _shown(distribution: Any) -> str:
    """A distribution in a few words: choice(a, b), float in [0.0, 1.0], log float in [...], int in [1, 8] step 2."""
    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return f"choice({', '.join(map(str, distribution.choices))})"
    integer = isinstance(distribution, optuna.distributions.IntDistribution)
    step = "" if distribution.step is None or (integer and distribution.step == 1) else f" step {distribution.step}"
    log = "log " if distribution.log else ""
    return f"{log}{'int' if integer else 'float'} in [{distribution.low}, {distribution.high}]{step}"


def trial_id(storage: Any, study_name: str, number: int) -> int:
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)


# ------------------------------------------------------------------------------------------------ workers
def worker_identity() -> list:
    """[machine, pid, start time]: enough to tell, on the same machine, that the worker is gone."""
    try:  # hostnames repeat across containers; a PID namespace does not
        machine = f"{socket.gethostname()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        machine = socket.gethostname()
    return [machine, os.getpid(), round(psutil.Process().create_time(), 2)]


def _dead_here(worker: Any, me: list) -> bool:
    if not isinstance(worker, list) or len(worker) != 3 or worker[0] != me[0]:
        return False  # another machine: only its heartbeat can tell
    try:
        return round(psutil.Process(worker[1]).create_time(), 2) != worker[2]  # pid reused by another process
    except psutil.NoSuchProcess:
        return True


class Heartbeat:
    """Records the trial's heartbeat now and every `interval` seconds while the trial runs, in a thread of the
    sweep process (training happens in other processes, or releases the GIL)."""

    def __init__(self, storage: Any, trial_id: int, interval: int):
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{trial_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.storage.record_heartbeat(self.trial_id)  # before anything else: a trial without one never goes stale
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception as err:  # a database hiccup must not end the trial; the next beat may work
                log.warning("heartbeat of trial id %d failed: %s", self.trial_id, str(err).splitlines()[0])


class Recovery:
    """Fails the RUNNING trials of dead workers and queues their params again; call it to recover, it returns
    the numbers of the trials it recovered.

    A worker is dead when optuna's RDBStorage finds its heartbeat older than grace_period; when its process is
    gone from this machine (told at once, so that re-running a killed sweep does not wait for the grace); or when
    it never claimed the trial it asked for: killed between `study.ask()` and its first heartbeat, it left a
    trial with neither heartbeat nor worker, which optuna never finds stale. Such a trial is recovered once it
    has stayed unclaimed for grace_period as this process saw it (its own clock: machines' clocks may differ).
    """

    def __init__(self, study: Any, storage: Any, me: list) -> None:
        self.study, self.storage, self.me = study, storage, me
        interval = storage.get_heartbeat_interval()
        self.grace = (storage.grace_period or 2 * interval) if interval else None
        self.unclaimed_since: dict[int, float] = {}  # trial number -> when this process first saw it unclaimed

    def __call__(self) -> list[int]:
        study, storage = self.study, self.storage
        # optuna's public fail_stale_trials fails the trial before any hook could record why; this private
        # query (stable since optuna 2) lets the reason be set while the trial is still RUNNING.
        study_id = storage.get_study_id_from_name(study.study_name)
        stale = set(storage._get_stale_trial_ids(study_id)) if self.grace else set()
        recovered = []
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            why = self._dead_worker(trial, stale)
            if why is None:
                continue
            try:
                storage.set_trial_user_attr(trial._trial_id, REASON, f"interrupted: {why}; params queued again")
                storage.set_trial_user_attr(trial._trial_id, INTERRUPTED, True)
                storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # raises for all but one worker
            except UpdateFinishedTrialError:
                continue
            study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number}, skip_if_exists=False)
            log.warning("trial %d was interrupted (%s): failed, its params queued again", trial.number, why)
            recovered.append(trial.number)
        return recovered

    def _dead_worker(self, trial: Any, stale: set[int]) -> str | None:
        """Why the trial's worker is known to be dead, or None while it may be alive."""
        worker = trial.user_attrs.get(WORKER)
        if _dead_here(worker, self.me):
            return "its worker process is gone"
        if trial._trial_id in stale:
            return "no heartbeat from its worker"
        if worker is not None or self.grace is None:
            return None
        first_seen = self.unclaimed_since.setdefault(trial.number, time.monotonic())
        if time.monotonic() - first_seen > self.grace:
            return f"no worker claimed it within {self.grace} s"
        return None


# ------------------------------------------------------------------------------------------------- budget
def counts(trial: Any) -> bool:
    """Whether a trial takes a place among n_trials (interrupted and surplus trials do not)."""
    return not (trial.user_attrs.get(INTERRUPTED) or trial.user_attrs.get(SURPLUS))


@dataclass
class Tally:
    complete: int = 0
    pruned: int = 0
    failed: int = 0  # failures that count (diverged, oom, crashed, ...), not interrupted ones
    interrupted: int = 0
    running: int = 0
    waiting: int = 0

    @property
    def finished(self) -> int:
        return self.complete + self.pruned + self.failed

    def may_ask(self, n_trials: int) -> bool:
        """Queued trials are part of the budget already; otherwise only while places are left."""
        return self.waiting > 0 or self.finished + self.running < n_trials


def tally(study: Any) -> Tally:
    result = Tally()
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get(SURPLUS):
            continue
        if trial.user_attrs.get(INTERRUPTED):
            result.interrupted += 1
            continue
        key = {
            TrialState.COMPLETE: "complete",
            TrialState.PRUNED: "pruned",
            TrialState.FAIL: "failed",
            TrialState.RUNNING: "running",
            TrialState.WAITING: "waiting",
        }[trial.state]
        setattr(result, key, getattr(result, key) + 1)
    return result


def last_failure(study: Any) -> str:
    """The reason recorded on the study's last counted failed trial ("none" without one)."""
    failed = [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if counts(t)]
    return failed[-1].user_attrs.get(REASON, "no reason recorded") if failed else "none"


def within_budget(study: Any, number: int, n_trials: int) -> bool:
    """Whether trial `number` is among the first n_trials counted ones. Two workers may ask for the last place
    at once; the lower number keeps it, the other trial is surplus (failed unrun, not counted)."""
    return sum(1 for t in study.get_trials(deepcopy=False) if t.number <= number and counts(t)) <= n_trials
