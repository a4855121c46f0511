"""A sweep trial as its job and ranks see it: its identity in the study and rank 0's pruning callback.

The sweeper hands a TrialContext to each trial beside the run's config, never inside it (no config key a user
could set): as JSON in LYCHEE_TRIAL, which Hydra sets for the job (hydra.job.env_set) and the ranks inherit
(warm ranks receive it with each job). Outside a sweep there is none.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from lychee_exp.errors import UserError

log = logging.getLogger(__name__)
TRIAL_ENV = "LYCHEE_TRIAL"


@dataclass(frozen=True)
class TrialContext:
    study_name: str
    number: int  # the trial's number in its study (names its directory)
    id: int = -1  # the storage's trial id, to report intermediate values to
    storage: str = ""  # `env:<VARIABLE>` holding the study's URL; empty: not pruned (multi-objective studies)
    pruner: dict = field(default_factory=dict)  # _target_ spec of the study's pruner (its null arguments dropped)
    placement: dict = field(default_factory=dict)  # hydra.sweeper.devices_per_trial's decision and its figures

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def record(self) -> dict:
        """What W&B's run config shows of the trial: all of it (the storage is the variable's name, never the URL)."""
        return asdict(self)


def current_trial(environ: Mapping[str, str] | None = None) -> TrialContext | None:
    text = (os.environ if environ is None else environ).get(TRIAL_ENV, "")
    return TrialContext(**json.loads(text)) if text else None


def trial_number(environ: Mapping[str, str] | None = None) -> int:
    """This job's trial number, -1 outside a sweep (fault injection and step hooks select trials by it)."""
    trial = current_trial(environ)
    return -1 if trial is None else trial.number


def masked(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def open_storage(url: str, heartbeat_interval: int | None = None, grace_period: int | None = None) -> Any:
    """An RDBStorage for any SQLAlchemy URL; a bad URL or an unreachable server is a UserError."""
    import optuna

    # sqlite: wait for the writer instead of failing with "database is locked" (rank 0 reports while the
    # sweeper beats), and let the begin hook below open each transaction; servers: drop connections that died
    # while a long trial ran.
    sqlite = url.startswith("sqlite")
    engine = {"connect_args": {"timeout": 60, "isolation_level": None}} if sqlite else {"pool_pre_ping": True}
    last: Exception | None = None
    for attempt in range(3):  # workers starting together may race to create the schema
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url, engine_kwargs=engine, heartbeat_interval=heartbeat_interval, grace_period=grace_period
                )
            if sqlite:
                _write_locked_transactions(storage.engine)
            return storage
        except Exception as err:
            last = err
            time.sleep(1 + attempt)
    raise UserError(f"hydra.sweeper.storage={masked(url)}: cannot open it: {str(last).splitlines()[0]}")


def _write_locked_transactions(engine: Any) -> None:
    """SQLite ignores optuna's SELECT ... FOR UPDATE, so two workers could both read a queued trial as WAITING
    and both run it (3 processes popping 40 queued trials ran 47). BEGIN IMMEDIATE takes the write lock when a
    transaction opens, which makes each read-then-write atomic across processes."""
    from sqlalchemy import event

    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))


@functools.lru_cache(maxsize=4)
def _storage(url: str) -> Any:
    """One storage per process and URL: a warm rank 0 reports for trial after trial of the same study, and
    opening the storage (engine, schema check) was a tenth of a warm trial's overhead."""
    return open_storage(url)


def pruning_callback(trial_ctx: TrialContext, metric: str) -> Callable[[int, dict], bool]:
    """(step, dev metrics) -> True to stop: rank 0 reports the dev metric to the trial after each evaluation and
    asks its pruner. The Trainer shares the decision with every rank and stops them all at the same step; the
    sweeper then records the trial PRUNED with its last reported value (metrics.json says stopped_early)."""
    import optuna
    from hydra.utils import instantiate

    url = trial_ctx.storage
    if url.startswith("env:"):  # the sweeper passes the URL (maybe with a password) in the environment
        url = os.environ[url[len("env:") :]]
    pruner = instantiate(trial_ctx.pruner) if trial_ctx.pruner else optuna.pruners.NopPruner()
    study = optuna.load_study(study_name=trial_ctx.study_name, storage=_storage(url), pruner=pruner)
    trial = optuna.trial.Trial(study, trial_ctx.id)

    def callback(step: int, metrics: dict) -> bool:
        try:
            trial.report(float(metrics[metric]), step)
            if trial.should_prune():
                trial.set_user_attr("pruned_at_step", step)
                log.info("trial %d pruned at step %d (%s %.4f)", trial_ctx.number, step, metric, metrics[metric])
                return True
        except Exception as err:  # e.g. the storage is unreachable: finishing the trial beats losing it
            log.warning(
                "trial %d: could not report to the study (%s); training goes on",
                trial_ctx.number,
                str(err).splitlines()[0],
            )
        return False

    return callback
