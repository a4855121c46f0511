"""Sweeps on the cluster's paths: each trial a submitit job (the local executor, as SLURM would run it), and
launch/slurm/sweep_array.sbatch as one array task."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import TINY_MULTI, cluster_env
from conftest import REPO_ROOT, run_metrics


@pytest.fixture(scope="module")
def submitit_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The acceptance command of issue 12 (on the tiny model): each trial a submitit job of 2 DDP ranks, n_jobs=2.
    Trials 0 and 1 train; rank 1 of trial 2 raises at step 2 (one sweep for both tests: it was two, and before
    that three)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    root = tmp_path_factory.mktemp("submitit")
    sweep = root / "sweep"
    tiny = [a for a in TINY_MULTI if not a.startswith(("optimizer.lr=", "data.batch_size="))]  # the swept keys
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lychee_exp.run",
            "-m",
            "hydra/launcher=slurm_local",
            "hparams_search=lr_batch",
            "hydra.sweeper.n_trials=3",
            "hydra.sweeper.n_jobs=2",
            "hydra.sweeper.max_failure_rate=1",
            "parallel=ddp",
            "gpus=2",
            "trainer.max_steps=4",
            "trainer.eval_every=2",
            *tiny,
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=root,
        env=cluster_env(LYCHEE_FAULT="1:2:raise:2"),
        text=True,
        capture_output=True,
        timeout=600,
        check=False,
    )
    return proc, sweep


@pytest.mark.slow
def test_sweep_trials_as_submitit_jobs(submitit_sweep):
    """With n_jobs=2 the two trials run at once, each reporting to the study (rank 0 to its own trial) while the
    sweeper keeps the books."""
    import optuna
    import yaml

    proc, sweep = submitit_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.parent.name for p in sweep.glob("*/metrics.json")) == ["0", "1"]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert (results["finished"], results["complete"], results["failed"], results["running"]) == (3, 2, 1, 0)
    assert len(list((sweep / ".submitit").iterdir())) >= 3  # three jobs, each with its own submitit folder
    with (sweep / "trials.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 3
    study = optuna.load_study(study_name="lr_batch", storage=f"sqlite:///{sweep / 'optuna.db'}")
    first, second = study.trials[:2]
    assert second.datetime_start < first.datetime_complete and first.datetime_start < second.datetime_complete
    for trial in (first, second):  # each job trained on its 2 ranks: both reported memory and wrote their own log
        m = run_metrics(sweep / str(trial.number))
        assert m["num_devices"] == m["num_processes"] == 2 and len(m["peak_memory_mb_per_rank"]) == 2, trial.number
        assert all(mb > 0 for mb in m["peak_memory_mb_per_rank"]), trial.number
        logs = sorted(p.parent.name for p in (sweep / str(trial.number)).glob("logs/**/stderr.log"))
        assert logs == ["0", "1"], trial.number
        assert m["effective_batch_size"] == trial.params["trainer.global_batch_size"]  # the trial's own params
        assert sorted(trial.intermediate_values)[:1] == [0]  # rank 0 reported to its own trial


@pytest.mark.slow
def test_a_failed_submitit_trial_is_recorded_with_its_reason(submitit_sweep):
    """A rank's failure inside a submitit job travels back to the sweeper (pickled) with its kind."""
    proc, sweep = submitit_sweep
    with (sweep / "trials.csv").open() as handle:
        rows = {row["number"]: row for row in csv.DictReader(handle)}
    assert rows["2"]["state"] == "FAIL", proc.stderr[-3000:]
    assert rows["2"]["reason"].startswith("crashed: rank 1 failed") and "injected fault" in rows["2"]["reason"]
    assert not (sweep / "2" / "metrics.json").exists()


@pytest.mark.slow
def test_sweep_array_script_runs_a_worker(tmp_path):
    """launch/slurm/sweep_array.sbatch as one array task, with a stand-in srun that runs its command here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    sweep = tmp_path / "sweep"
    tiny = [a for a in TINY_MULTI if not a.startswith(("optimizer.lr=", "data.batch_size="))]
    env = cluster_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        SLURM_ARRAY_TASK_ID="0",
        SLURM_ARRAY_TASK_MIN="0",
        LYCHEE_STORAGE=f"sqlite:///{tmp_path / 'study.db'}",
    )
    proc = subprocess.run(
        [
            "bash",
            str(REPO_ROOT / "launch/slurm/sweep_array.sbatch"),
            "hparams_search=lr_batch",
            "hydra.sweeper.n_trials=1",
            "gpus=2",
            *tiny,
            "trainer.measure_speedup=false",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (sweep / "0" / "metrics.json").is_file() and run_metrics(sweep / "0")["num_devices"] == 2
    refused = subprocess.run(
        ["bash", str(REPO_ROOT / "launch/slurm/sweep_array.sbatch")],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        check=False,
        env={**env, "LYCHEE_STORAGE": "postgresql+psycopg2://u:secret@db/optuna"},
    )
    assert refused.returncode == 2 and "password" in refused.stderr and "secret" not in refused.stderr
