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
