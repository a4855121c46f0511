"""Rank 0's side of pruning: report the dev metric to the trial after each evaluation and ask its pruner.
(Imported by the training recipe only when its job is a sweep trial.)

The Trainer shares the returned decision with every rank and stops them all at the same step; the sweeper
then records the trial PRUNED with its last reported value (metrics.json says stopped_early).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

import optuna

from lychee_exp.sweep.samplers import build_pruner
from lychee_exp.sweep.storage import open_storage

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _storage(url: str) -> Any:
    """One storage per process and URL: a warm rank 0 reports for trial after trial of the same study, and
    opening the storage (engine, schema check) was a tenth of a warm trial's overhead."""
    return open_storage(url)


def pruning_callback(trial_cfg: Any, metric: str) -> Callable[[int, dict], bool]:
    """(step, dev metrics) -> True to stop, for trial_cfg.id of study trial_cfg.study_name."""
    url = trial_cfg.storage
    if url.startswith("env:"):  # the sweeper passes the URL (maybe with a password) in the environment
        url = os.environ[url[len("env:") :]]
    study = optuna.load_study(
        study_name=trial_cfg.study_name, storage=_storage(url), pruner=build_pruner(trial_cfg.pruner)
    )
    trial = optuna.trial.Trial(study, trial_cfg.id)

    def callback(step: int, metrics: dict) -> bool:
        try:
            trial.report(float(metrics[metric]), step)
            if trial.should_prune():
                trial.set_user_attr("pruned_at_step", step)
                log.info("trial %d pruned at step %d (%s %.4f)", trial_cfg.number, step, metric, metrics[metric])
                return True
        except Exception as err:  # e.g. the storage is unreachable: finishing the trial beats losing it
            log.warning(
                "trial %d: could not report to the study (%s); training goes on",
                trial_cfg.number,
                str(err).splitlines()[0],
            )
        return False

    return callback
