"""One trial's life: asked (main thread) -> its overrides and heartbeat -> launched as a Hydra job (main thread,
or a slot thread) -> its Outcome, an OOM retry if asked for -> told to the study (main thread).
Where trials run (one at a time, in batches, in slots) is lychee_exp.sweep.placement's concern.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from optuna.exceptions import UpdateFinishedTrialError

from lychee_exp.sweep import lychee_trials
from lychee_exp.sweep import storage as st
from lychee_exp.sweep.outcome import Outcome, job_outcome
from lychee_exp.sweep.space import render

log = logging.getLogger(__name__)
PLACEMENT = "placement"  # study attribute: devices_per_trial's decision (results, and each trial's W&B config)


@dataclass
class TrialSettings:
    """What every trial of one sweep shares: the runner is given these, never the sweeper."""

    launcher: Any
    sweep_dir: Path
    n_objectives: int = 1
    objectives: Sequence[str] | None = None  # metrics.json keys (lychee_exp jobs); None: the task's return value
    oom_retry: bool = False
    lychee: bool = False  # the trials are lychee_exp jobs: a TrialContext each, and the OOM retry
    config_loader: Any = None  # Hydra's, to compose a trial's config (the OOM retry)
    sweep_config: Any = None
    space: Any = None  # lychee_exp.sweep.space.Space
    study: Any = None
    storage: Any = None
    storage_url: str = ""
    worker: Any = None  # this worker's identity (storage.worker_identity)
    heartbeat_interval: int = 60
    pruner_spec: dict = field(default_factory=dict)
    tell: Callable[..., None] | None = None  # (trial, values, state): the sweeper's, which notes a spent grid


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
    """Sets up, runs and tells the trials of one sweep."""

    def __init__(self, settings: TrialSettings) -> None:
        self.settings = settings
        self._compose = threading.Lock()  # Hydra's config loader is shared by the main and slot threads

    # ------------------------------------------------------------------------------ main thread: set up
    def start(self, trial: Any) -> Pending | None:
        """The trial claimed by this worker, its params drawn and its job's overrides made; None when another
        worker had already failed it as unclaimed (this one stalled for longer than the grace period)."""
        shared = self.settings
        pending = Pending(trial, st.trial_id(shared.storage, shared.study.study_name, trial.number))
        # Heartbeat first, then the claim: a worker killed in between leaves a heartbeat that goes stale; one
        # killed before both leaves an unclaimed trial, which st.Recovery fails after the grace period. The
        # sampler draws only after the claim, since a model-based sampler can take longer than that grace.
        pending.heartbeat = st.Heartbeat(shared.storage, pending.trial_id, shared.heartbeat_interval).__enter__()
        try:
            trial.set_user_attr(st.WORKER, shared.worker)
        except UpdateFinishedTrialError:
            pending.heartbeat.__exit__(None, None, None)
            log.warning("trial %d was failed as unclaimed by another worker before this one claimed it", trial.number)
            return None
        shared.space.suggest(trial)
        try:
            params = shared.space.params(trial, shared.sweep_config)
        except Exception as err:  # custom_search_space failed for this trial only (its first run passed)
            reason = f"config: custom_search_space: {str(err).strip().splitlines()[0]}"[:500]
            pending.outcome = Outcome("FAIL", reason=reason, kind="config")
            return pending
        overrides = shared.space.overrides(params) + [f"hydra.sweep.dir={render(str(shared.sweep_dir))}"]
        if shared.lychee:
            context = lychee_trials.trial_context(
                trial.number,
                pending.trial_id,
                shared.study.study_name,
                shared.pruner_spec,
                shared.n_objectives > 1,
                shared.study.user_attrs.get(PLACEMENT) or {},
            )
            overrides.append(lychee_trials.trial_override(context, shared.storage_url))
        log.info("trial %d: %s", trial.number, ", ".join(f"{k}={v}" for k, v in params.items()) or "fixed config")
        pending.overrides, pending.name = overrides, self._claim(str(trial.number))
        trial.set_user_attr(st.RUN_DIR, str(shared.sweep_dir / pending.name))
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
        shared = self.settings
        jobs = [[*p.overrides, f"hydra.sweep.subdir={p.name}"] for p in batch]
        try:
            returns = shared.launcher.launch(jobs, initial_job_idx=batch[0].trial.number)
        except Exception as err:  # a job's config did not compose, or the launcher lost the job
            kind = "config" if "Composition" in type(err).__name__ or "Override" in type(err).__name__ else "crashed"
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return [Outcome("FAIL", reason=f"{kind}: {message}"[:500], kind=kind) for _ in batch]
        return [
            job_outcome(ret, shared.sweep_dir / p.name, shared.n_objectives, shared.objectives)
            for p, ret in zip(batch, returns, strict=True)
        ]

    def _maybe_retry(self, pending: Pending) -> Outcome:
        shared, outcome = self.settings, pending.outcome
        if not (outcome.kind == "oom" and shared.oom_retry and shared.lychee):
            return outcome
        with self._compose:
            job_cfg = shared.config_loader.load_sweep_config(shared.sweep_config, pending.overrides)
        retry = lychee_trials.oom_retry_overrides(pending.overrides, job_cfg)
        if retry is None:
            return outcome
        overrides, halved = retry
        number = pending.trial.number
        data_keys = ("batch_size", "max_tokens_per_batch")
        changed = ", ".join(f"{'data' if key in data_keys else 'trainer'}.{key}={v}" for key, v in halved.items())
        log.warning("trial %d ran out of memory: retrying once with %s", number, changed)
        pending.trial.set_user_attr("oom_retry", halved)
        again = Pending(pending.trial, pending.trial_id, overrides, self._claim(f"{number}-oom-retry"))
        pending.trial.set_user_attr(st.RUN_DIR, str(shared.sweep_dir / again.name))
        pending.outcome = self._launch([again])[0]
        return pending.outcome

    def _claim(self, name: str) -> str:
        """A directory name not taken yet (a study re-created in an old sweep dir must not overwrite old runs);
        created at once, so that two trials in flight never pick the same one."""
        with self._compose:
            self.settings.sweep_dir.mkdir(parents=True, exist_ok=True)
            candidate, k = name, 1
            while True:
                try:  # mkdir, not a look first: another worker of the study may take the same name meanwhile
                    (self.settings.sweep_dir / candidate).mkdir()
                    return candidate
                except FileExistsError:
                    k += 1
                    candidate = f"{name}-{k}"

    # ----------------------------------------------------------------------------- main thread: tell
    def finish(self, pending: Pending) -> Outcome:
        outcome, trial = pending.outcome, pending.trial
        assert outcome is not None
        try:
            trial.set_user_attr(st.METRICS, outcome.metrics)
            if outcome.reason:
                trial.set_user_attr(st.REASON, outcome.reason)
            self.settings.tell(trial, values=outcome.values, state=outcome.state)
        finally:
            pending.heartbeat.__exit__(None, None, None)
        log.info(
            "trial %d: %s%s",
            trial.number,
            outcome.state,
            f" {outcome.values}" if outcome.values else f" ({outcome.reason})" if outcome.reason else "",
        )
        return outcome
