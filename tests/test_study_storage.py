"""The sweep's study storage under concurrent workers: a queued trial (a re-run of an interrupted one) is taken by
exactly one worker, also on SQLite, which ignores the SELECT ... FOR UPDATE optuna relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna

from lychee_exp.tracking.trial import open_storage

# each worker pops queued trials until none is left, all starting at the same moment
POP_ALL = """
import json, sys, time
import optuna
from lychee_exp.tracking.trial import open_storage
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name="queue", storage=open_storage(sys.argv[1]))
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
popped = []
while (trial_id := study._pop_waiting_trial_id()) is not None:
    popped.append(trial_id)
print(json.dumps(popped))
"""


def test_each_queued_trial_is_taken_by_one_worker_on_sqlite(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="queue", storage=open_storage(url))
    for x in range(40):
        study.enqueue_trial({"x": x})
    start = time.time() + 4  # after every worker's imports
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    workers = [
        subprocess.Popen([sys.executable, "-c", POP_ALL, url, str(start)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    popped = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
    taken = sum(popped, [])
    # with optuna's own SQLite transactions, 3 workers took 47 of 40 (7 trials ran twice)
    assert sorted(taken) == sorted(t._trial_id for t in study.get_trials()), popped
    assert {t.state for t in study.get_trials()} == {optuna.trial.TrialState.RUNNING}


def test_a_trial_being_drawn_by_another_worker_is_no_other_search_space():
    """A second slot worker starting while the first one's trial has drawn only some of its parameters (a RUNNING
    trial, mid-suggest) saw `this sweep adds ...` and ended with exit 2 (issue 51's run found it). Only trials that
    drew all their parameters say which ones the study has; a finished trial with fewer still is refused."""
    import pytest

    from lychee_exp.errors import UserError
    from lychee_exp.sweep.storage import check_search_space

    lr = optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)
    batch = optuna.distributions.CategoricalDistribution([4, 8])
    study = optuna.create_study()
    drawing = study.ask()
    drawing.suggest_float("lr", 1e-5, 1e-3, log=True)  # the other worker has not drawn the batch size yet
    check_search_space(study, {"lr": lr, "batch": batch}, custom=False)
    done = study.ask()
    done.suggest_float("lr", 1e-5, 1e-3, log=True)
    study.tell(done, 0.5)
    with pytest.raises(UserError, match=r"this sweep adds batch, against the 1 parameter\(s\)"):
        check_search_space(study, {"lr": lr, "batch": batch}, custom=False)
