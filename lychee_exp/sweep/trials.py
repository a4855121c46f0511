"""One trial's life: asked (main thread) -> its overrides and heartbeat -> launched as a Hydra job (main thread,
or a slot thread) -> its Outcome, an OOM retry if asked for -> told to the study (main thread).

How trials reach the launcher (`launch_mode`):
  one     n_jobs 1, or Hydra's basic launcher (it runs jobs in this process, one after another): the job runs
          in the main thread (it may install signal handlers, change directory).
  slots   hydra-submitit-launcher (submitit_local, submitit_slurm, slurm, slurm_local): every trial is its own
          `launcher.launch([job])` call in its own thread; each call is a separate submitit job (array of one),
          so up to n_jobs run at once and a slot is refilled as soon as its trial ends.
  batch   any other launcher (joblib, ray, ...): up to n_jobs trials in one `launcher.launch(batch)` call, which
          runs them at once; the next batch waits for the slowest trial (these launchers are not known to be
          safe to call from several threads at once).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from optuna.exceptions import UpdateFinishedTrialError

from lychee_exp.sweep import lychee_job, slot_sweep
from lychee_exp.sweep import storage as st
from lychee_exp.sweep.outcome import Outcome, job_outcome
from lychee_exp.sweep.space import render

log = logging.getLogger(__name__)

BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
SUBMITIT = "hydra_plugins.hydra_submitit_launcher."


def launch_mode(launcher: Any, n_jobs: int) -> str:
    """one | slots | batch (see the module's docstring)."""
    names = [f"{c.__module__}.{c.__qualname__}" for c in type(launcher).__mro__]
    if n_jobs <= 1 or BASIC in names:
        return "one"
    if any(name.startswith(SUBMITIT) for name in names):
        return "slots"
    return "batch"


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


@dataclass
class Pending:
    """A trial asked and set up, not yet told."""

    trial: Any
    trial_id: int
    overrides: list[str] = field(default_factory=list)
    name: str = ""
    heartbeat: Any = None
    outcome: Outcome | None = None  # set before launch when the trial cannot run (custom_search_space failed)


class TrialRunner:
    """What every trial needs from the sweeper: its space, launcher, study, and the lychee_exp extras."""

    def __init__(self, sweeper: Any) -> None:
        self.sw = sweeper
        self._compose = threading.Lock()  # Hydra's config loader is shared by the main and slot threads

    # ------------------------------------------------------------------------------ main thread: set up
    def start(self, trial: Any) -> Pending | None:
        """The trial claimed by this worker, its params drawn and its job's overrides made; None when another
        worker had already failed it as unclaimed (this one stalled for longer than the grace period)."""
        sw = self.sw
        pending = Pending(trial, st.trial_id(sw.storage, sw.study.study_name, trial.number))
        # Heartbeat first, then the claim: a worker killed in between leaves a heartbeat that goes stale; one
        # killed before both leaves an unclaimed trial, which st.Recovery fails after the grace period. The
        # sampler draws only after the claim, since a model-based sampler can take longer than that grace.
        pending.heartbeat = st.Heartbeat(sw.storage, pending.trial_id, sw.heartbeat_interval).__enter__()
        try:
            trial.set_user_attr(st.WORKER, sw.me)
        except UpdateFinishedTrialError:
            pending.heartbeat.__exit__(None, None, None)
            log.warning("trial %d was failed as unclaimed by another worker before this one claimed it", trial.number)
            return None
        sw.space.suggest(trial)
        try:
            params = sw.space.params(trial, sw.config)
        except Exception as err:  # custom_search_space failed for this trial only (its first run passed)
            reason = f"config: custom_search_space: {str(err).strip().splitlines()[0]}"[:500]
            pending.outcome = Outcome("FAIL", reason=reason, kind="config")
            return pending
        overrides = sw.space.overrides(params) + [f"hydra.sweep.dir={render(str(sw.sweep_dir))}"]
        if sw.lychee:
            overrides += lychee_job.trial_overrides(
                trial.number, pending.trial_id, sw.url, sw.study.study_name, sw.pruner_spec, len(sw.directions) > 1
            )
            overrides += [line for line in [slot_sweep.record_line(sw)] if line]
        log.info("trial %d: %s", trial.number, ", ".join(f"{k}={v}" for k, v in params.items()) or "fixed config")
        pending.overrides, pending.name = overrides, self._claim(str(trial.number))
        trial.set_user_attr(st.RUN_DIR, str(sw.sweep_dir / pending.name))
        return pending

    # ----------------------------------------------------------------------- any thread: run the job(s)
    def execute(self, pending: Pending) -> Outcome:
        """Runs one trial (in a slot thread or the main thread), and its OOM retry."""
        if pending.outcome is None:
            pending.outcome = self._launch([pending])[0]
        return self._maybe_retry(pending)

    def execute_batch(self, batch: Sequence[Pending]) -> None:
        """Runs a batch through one launch() call (its launcher runs the jobs at once), then OOM retries."""
        ready = [p for p in batch if p.outcome is None]
        if ready:
            for pending, outcome in zip(ready, self._launch(ready), strict=True):
                pending.outcome = outcome
        for pending in batch:
            self._maybe_retry(pending)

    def _launch(self, batch: Sequence[Pending]) -> list[Outcome]:
        sw = self.sw
        jobs = [[*p.overrides, f"hydra.sweep.subdir={p.name}"] for p in batch]
        try:
            returns = sw.launcher.launch(jobs, initial_job_idx=batch[0].trial.number)
        except Exception as err:  # a job's config did not compose, or the launcher lost the job
            kind = "config" if "Composition" in type(err).__name__ or "Override" in type(err).__name__ else "crashed"
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return [Outcome("FAIL", reason=f"{kind}: {message}"[:500], kind=kind) for _ in batch]
        return [
            job_outcome(ret, sw.sweep_dir / p.name, len(sw.directions), sw.objectives)
            for p, ret in zip(batch, returns, strict=True)
        ]

    def _maybe_retry(self, pending: Pending) -> Outcome:
        sw, outcome = self.sw, pending.outcome
        if not (outcome.kind == "oom" and sw.oom_retry and sw.lychee):
            return outcome
        with self._compose:
            job_cfg = sw.hydra_context.config_loader.load_sweep_config(sw.config, pending.overrides)
        retry = lychee_job.oom_retry_overrides(pending.overrides, job_cfg)
        if retry is None:
            return outcome
        overrides, halved = retry
        number = pending.trial.number
        data_keys = ("batch_size", "max_tokens_per_batch")
        changed = ", ".join(f"{'data' if key in data_keys else 'trainer'}.{key}={v}" for key, v in halved.items())
        log.warning("trial %d ran out of memory: retrying once with %s", number, changed)
        pending.trial.set_user_attr("oom_retry", halved)
        again = Pending(pending.trial, pending.trial_id, overrides, self._claim(f"{number}-oom-retry"))
        pending.trial.set_user_attr(st.RUN_DIR, str(sw.sweep_dir / again.name))
        pending.outcome = self._launch([again])[0]
        return pending.outcome

    def _claim(self, name: str) -> str:
        """A directory name not taken yet (a study re-created in an old sweep dir must not overwrite old runs);
        created at once, so that two trials in flight never pick the same one."""
        with self._compose:
            candidate, k = name, 1
            while (self.sw.sweep_dir / candidate).exists():
                k += 1
                candidate = f"{name}-{k}"
            Path(self.sw.sweep_dir / candidate).mkdir(parents=True)
            return candidate

    # ----------------------------------------------------------------------------- main thread: tell
    def finish(self, pending: Pending) -> Outcome:
        outcome, trial = pending.outcome, pending.trial
        assert outcome is not None
        try:
            trial.set_user_attr(st.METRICS, outcome.metrics)
            if outcome.reason:
                trial.set_user_attr(st.REASON, outcome.reason)
            self.sw.tell(trial, values=outcome.values, state=outcome.state)
        finally:
            pending.heartbeat.__exit__(None, None, None)
        log.info(
            "trial %d: %s%s",
            trial.number,
            outcome.state,
            f" {outcome.values}" if outcome.values else f" ({outcome.reason})" if outcome.reason else "",
        )
        return outcome
