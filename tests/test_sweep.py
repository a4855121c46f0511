"""The lychee_optuna sweeper on CPU: a DDP sweep and its results, failures, pruning, resume after SIGKILL,
two workers sharing PostgreSQL, a ported lightning-hydra-template search config, and bad sweep configs.

Every sweep is the real CLI (`python -m lychee_exp.run -m ...`) in a scratch directory, on the tiny model.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import CONF_DIR, TINY_RANKS
from hydra_in_process import run_in_process
from optuna.trial import TrialState

from lychee_exp.sweep.storage import (
    INTERRUPTED,
    RETRY_OF,
    SURPLUS,
    WORKER,
    Heartbeat,
    Recovery,
)
from lychee_exp.tracking.trial import open_storage

# the per-device batch searched, lr_batch's global batch fixed off (test_device_slots sweeps the global batch)
TINY = [*TINY_RANKS, "trainer.save_model=false", "data.batch_size=choice(1,2)", "trainer.global_batch_size=null"]
SINGLE = ["parallel=single", "gpus=1"]

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    env.pop("LYCHEE_FAULT", None)
    return {**env, **extra}


def _command(sweep_dir: Path, *args: str, search: str = "hparams_search=lr_batch") -> list[str]:
    return [
        sys.executable,
        "-m",
        "lychee_exp.run",
        "-m",
        search,
        *TINY,
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweeper.heartbeat_interval=1",
        *args,
    ]


def _sweep(tmp_path: Path, *args: str, timeout: float = 400, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        _command(tmp_path / "sweep", *args, **kw),
        cwd=tmp_path,
        env=_env(),
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    return proc


def _env_here(monkeypatch) -> None:
    """_env() in this process's environment, for a sweep run in this process (restored after the test)."""
    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LYCHEE_FAULT", raising=False)


@pytest.fixture
def sweep_here(tmp_path, capfd, monkeypatch):
    """sweep_here(*args): _sweep's command run in this process (torch and the sweeper imported once for all): for
    single-device sweeps whose behaviour is the sweeper's; the other sweeps here are the command line itself."""
    from lychee_exp.run import main

    _env_here(monkeypatch)

    def sweep_here(*args: str) -> subprocess.CompletedProcess:
        return run_in_process(main, _command(tmp_path / "sweep", *args)[2:], tmp_path, capfd, monkeypatch, 400)

    return sweep_here


def _study(sweep_dir: Path, name: str = "lr_batch", url: str | None = None) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=url or f"sqlite:///{sweep_dir / 'optuna.db'}")


def _rows(sweep_dir: Path) -> list[dict]:
    with (sweep_dir / "trials.csv").open() as handle:
        return list(csv.DictReader(handle))


def _counted_finished(study: optuna.Study) -> list:
    return [
        t
        for t in study.trials
        if t.state.is_finished() and not t.user_attrs.get(INTERRUPTED) and not t.user_attrs.get(SURPLUS)
    ]


def _write_search(tmp_path: Path, name: str, text: str) -> str:
    folder = tmp_path / "conf" / "hparams_search"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(text)
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


# ------------------------------------------------------------------------------------------------ plots
def _lr_batch_trial(study: optuna.Study, value: float) -> None:
    trial = study.ask(
        {
            "optimizer.lr": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True),
            "data.batch_size": optuna.distributions.CategoricalDistribution([4, 8, 16]),
        }
    )
    study.tell(trial, value)


def test_plots_are_drawn_once_per_set_of_trials_and_quietly(tmp_path, caplog):
    """A finished study reopened does not redraw its plots (seconds each time: 17 s on a real sweep) while its
    trials are those they were drawn from; a new trial, or a plot file gone, redraws them. matplotlib's advice on
    the categorical batch sizes (4 INFO lines per sweep) is not said. Would fail if every call redrew (mtimes), if
    the stamp outlived a new trial, or with the advice back."""
    import logging

    from lychee_exp.sweep.sweep_results import PLOTS_STAMP, write_sweep_results

    caplog.set_level(logging.INFO)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for value in (0.3, 0.4, 0.35):
        _lr_batch_trial(study, value)

    def drawn() -> dict[str, int]:
        write_sweep_results(study, tmp_path, 4, "model_ndcg@10", "sqlite://")
        return {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.*") if p.suffix in (".png", ".html")}

    first = drawn()
    assert len(first) == 8 and (tmp_path / PLOTS_STAMP).is_file()  # 4 plots, as HTML and PNG
    assert not [r for r in caplog.records if "categorical units" in r.getMessage()]
    assert drawn() == first  # reopened: the same trials, the same files, not redrawn
    (tmp_path / "slice.png").unlink()
    redrawn = drawn()
    assert redrawn.keys() == first.keys() and all(redrawn[name] != first[name] for name in first)
    _lr_batch_trial(study, 0.5)
    assert all(mtime != redrawn[name] for name, mtime in drawn().items())


# ------------------------------------------------------------------------------------------------ sweeps
@pytest.mark.slow
def test_four_trial_ddp_sweep_and_its_results(tmp_path):
    proc = _sweep(tmp_path, "parallel=ddp", "gpus=2", "hydra.sweeper.n_trials=4")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    sweep = tmp_path / "sweep"
    study = _study(sweep)
    assert len(_counted_finished(study)) == 4 and len(study.trials) == 4
    values = {}
    for trial in study.trials:
        metrics = json.loads((sweep / str(trial.number) / "metrics.json").read_text())
        assert metrics["num_devices"] == 2 and metrics["per_device_batch_size"] == trial.params["data.batch_size"]
        assert metrics["base_lr"] == pytest.approx(trial.params["optimizer.lr"])
        if trial.state == TrialState.COMPLETE:  # the trained model's own figure, not the mix with the teacher
            values[trial.number] = metrics["model_ndcg@10"]
            assert metrics["mix"] == "the teacher at 0.7" and metrics["ndcg@10"] != metrics["model_ndcg@10"]
    summary = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = max(values, key=values.get)  # the trial whose model alone is best
    assert summary["best_value"] == values[best] and summary["best_trial"] == best
    assert summary["best_params"] == study.trials[best].params
    assert summary["complete"] + summary["pruned"] + summary["failed"] == 4
    rows = _rows(sweep)
    assert len(rows) == 4 and [int(r["number"]) for r in rows] == [0, 1, 2, 3]
    for row in rows:  # the model and the mix as separate, named columns
        metrics = json.loads((sweep / row["number"] / "metrics.json").read_text())
        assert float(row["model_ndcg@10"]) == metrics["model_ndcg@10"] and row["mix"] == "the teacher at 0.7"
        assert float(row["mix_ndcg@10"]) == metrics["ndcg@10"]
    assert all(
        r["state"] in ("COMPLETE", "PRUNED")
        and int(r["effective_batch_size"]) == 2 * int(r["per_device_batch_size"])
        and float(r["duration_s"]) > 0
        for r in rows
    )
    for plot in ("optimization_history", "param_importances", "slice", "contour_lr_batch"):
        html = (sweep / f"{plot}.html").read_text()
        assert "plotly" in html and len(html) > 1_000_000, plot  # plotly.js inside: opens offline
        png = (sweep / f"{plot}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5_000, plot  # an image docs can embed
    # the results files' locks (trials.csv.lock stayed beside it) and the trials' own go when their holders let go
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_diverging_trial_fails_and_the_sweep_goes_on(sweep_here, tmp_path):
    proc = sweep_here(
        *SINGLE,
        "optimizer.lr=choice(0.001,1e30)",
        "optimizer.max_grad_norm=0",
        "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.max_failure_rate=0.5",
        "data.batch_size=2",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    study = _study(tmp_path / "sweep")
    by_lr = {t.params["optimizer.lr"]: t for t in study.trials}
    assert len(_counted_finished(study)) == 2 and set(by_lr) == {0.001, 1e30}
    assert by_lr[1e30].state == TrialState.FAIL
    assert by_lr[1e30].user_attrs["fail_reason"].startswith("diverged:")
    assert by_lr[0.001].state == TrialState.COMPLETE
    rows = {float(r["lr"]): r for r in _rows(tmp_path / "sweep")}
    assert rows[1e30]["state"] == "FAIL" and "loss is" in rows[1e30]["reason"]


@pytest.mark.slow
def test_too_many_failures_stop_the_sweep(sweep_here, tmp_path):
    proc = sweep_here(
        *SINGLE,
        "optimizer.lr=choice(1e30)",
        "optimizer.max_grad_norm=0",
        "hydra.sweeper.n_trials=6",
        "hydra.sweeper.max_failure_rate=0.2",
        "data.batch_size=2",
    )
    assert proc.returncode == 1
    output = (proc.stdout + proc.stderr).splitlines()
    assert [line for line in output if "error:" in line and "max_failure_rate" in line], output[-20:]
    study = _study(tmp_path / "sweep")
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2  # 2 > 0.2 x 6: no third trial


@pytest.mark.slow
def test_an_oom_trial_is_retried_once_with_half_the_batch(sweep_here, tmp_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_FAULT", "0:1:oom")  # every attempt runs out of memory at step 1
    args = ["hydra.sweeper.n_trials=1", "hydra.sweeper.oom_retry=true", "data.batch_size=2"]
    proc = sweep_here(*SINGLE, *args, "trainer.grad_accum_steps=1")
    # its only trial failed, retry included: the sweep ends with one line and exit 1 (no trial completed)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: no trial completed: 1 of 1 failed (reasons in {tmp_path / 'sweep'}/trials.csv)"
    ]
    [trial] = _study(tmp_path / "sweep").trials
    assert trial.state == TrialState.FAIL and trial.user_attrs["fail_reason"].startswith("oom:")
    assert trial.user_attrs["oom_retry"] == {"batch_size": 1, "grad_accum_steps": 2}
    retried = yaml.safe_load((tmp_path / "sweep" / "0-oom-retry" / "config.yaml").read_text())
    assert (retried["data"]["batch_size"], retried["trainer"]["grad_accum_steps"]) == (1, 2)
    assert (tmp_path / "sweep" / "0" / "config.yaml").is_file()  # the first attempt's directory is kept


@pytest.mark.slow
def test_another_experiment_is_refused_by_the_study_before_any_trial(sweep_here, tmp_path):
    """The study and sweep dir are named by the search config (lr_batch): the same search with another experiment
    found the earlier study (`1/1 trials finished ... this worker ran 0`, the old study's best). It is refused in
    one line naming the keys, before any trial; the same command on other devices resumes the study."""
    assert sweep_here(*SINGLE, "hydra.sweeper.n_trials=1").returncode == 0
    sweep = tmp_path / "sweep"
    recorded, written = _study(sweep).user_attrs["fixed_config"], (sweep / "multirun.yaml").read_text()
    command = _command(sweep, *SINGLE, "hydra.sweeper.n_trials=2", "experiment=tiny_smoke")
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=120)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0] in proc.stderr, lines
    assert lines[0].startswith(
        f"error: fixed config: this sweep differs from study 'lr_batch' in sqlite:///{sweep.resolve()}/optuna.db: "
    ), lines
    assert "(group choices: experiment=tiny_smoke (study: quickstart))" in lines[0]
    assert lines[0].endswith("use another hydra.sweeper.study_name=<name> (or storage) for another fixed config")
    study = _study(sweep)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] and study.user_attrs["fixed_config"] == recorded
    assert (sweep / "multirun.yaml").read_text() == written
    # where the trials run is no part of the study's config (slot workers get gpus=N): it resumes, nothing to do
    proc = sweep_here("parallel=ddp", "gpus=2", "logger=none", "hydra.sweeper.n_trials=1")
    assert proc.returncode == 0 and "1/1 trials finished" in proc.stdout + proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_pruning_stops_a_hopeless_trial_on_every_rank(tmp_path):
    # model_ndcg@10 never reaches 2: the pruner condemns the trial at its first evaluation after warm-up (step 2)
    searchpath = _write_search(
        tmp_path,
        "hopeless",
        """# @package _global_
defaults:
  - override /hydra/sweeper: lychee_optuna
hydra:
  sweeper:
    study_name: hopeless
    direction: maximize
    n_trials: 1
    pruner:
      _target_: optuna.pruners.ThresholdPruner
      lower: 2.0
      n_warmup_steps: 2
    params:
      optimizer.lr: tag(log, interval(1e-4, 1e-3))
""",
    )
    proc = _sweep(
        tmp_path,
        "parallel=ddp",
        "gpus=2",
        "trainer.eval_every=1",
        "trainer.max_steps=6",
        searchpath,
        search="hparams_search=hopeless",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    [trial] = _study(tmp_path / "sweep", "hopeless").trials
    metrics = json.loads((tmp_path / "sweep" / "0" / "metrics.json").read_text())
    assert trial.state == TrialState.PRUNED and trial.user_attrs["pruned_at_step"] == 2
    assert metrics["stopped_early"] is True and metrics["steps"] == 2 < 6 and metrics["num_devices"] == 2
    # the pruner judged the model's own figure, not the mix with the teacher
    assert trial.value == pytest.approx(metrics["model_ndcg@10"]) == trial.intermediate_values[2]
    assert metrics["model_ndcg@10"] != metrics["ndcg@10"]
    assert sorted(trial.intermediate_values) == [0, 1, 2]
    assert _rows(tmp_path / "sweep")[0]["state"] == "PRUNED"


@pytest.mark.slow
def test_sigkill_mid_trial_then_the_same_command_finishes_the_study(tmp_path):
    sweep = tmp_path / "sweep"
    command = _command(sweep, *SINGLE, "hydra.sweeper.n_trials=3", "trainer.max_steps=8")
    proc = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (sweep / "1" / "run.log").exists():  # trial 1 has started its job
        assert proc.poll() is None and time.monotonic() < deadline, "trial 1 never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    before = {path: path.stat().st_mtime_ns for path in sorted(sweep.glob("[01]/**/*")) if path.is_file()}
    first = json.loads((sweep / "0" / "metrics.json").read_text())

    again = subprocess.run(command, cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    study = _study(sweep)
    finished = _counted_finished(study)
    assert len(finished) == 3 and [t.number for t in finished] == [0, 2, 3]
    interrupted = study.trials[1]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs[INTERRUPTED]
    assert "worker process is gone" in interrupted.user_attrs["fail_reason"]
    assert study.trials[2].user_attrs[RETRY_OF] == 1 and study.trials[2].params == interrupted.params
    # nothing finished was re-run, no directory overwritten: trial 0's and 1's files are untouched
    assert json.loads((sweep / "0" / "metrics.json").read_text()) == first
    assert {path: path.stat().st_mtime_ns for path in before} == before
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    summary = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert (summary["finished"], summary["interrupted"]) == (3, 1)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_live_workers_trial_is_left_alone_until_its_heartbeat_stops(tmp_path):
    """A RUNNING trial of a worker on another machine: recovered only after grace_period without heartbeat."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    storage = open_storage(url, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    trial.set_user_attr(WORKER, ["another-machine:1", 4242, 1.0])
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name("s"), trial.number)
    recover = Recovery(study, storage, me=["this-machine:1", os.getpid(), 0.0])
    with Heartbeat(storage, trial_id, interval=1):
        time.sleep(3.5)  # longer than the grace period, but the worker beats
        assert recover() == []
    time.sleep(4)  # now it has stopped beating: its worker is gone
    assert recover() == [0]
    assert recover() == []  # once
    states = [(t.state, t.user_attrs.get(RETRY_OF)) for t in study.trials]
    assert states == [(TrialState.FAIL, None), (TrialState.WAITING, 0)]
    assert study.trials[1].system_attrs["fixed_params"] == trial.params  # what the next ask() gets


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_trial_its_worker_never_claimed_is_recovered_after_the_grace_period(tmp_path):
    """A worker killed between study.ask() and its first heartbeat leaves a RUNNING trial with neither heartbeat
    nor worker, which optuna never finds stale: once it has stayed so for grace_period, it is recovered; a trial
    claimed in time is left alone."""
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    orphan, claimed = (study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}) for _ in range(2))
    recover = Recovery(study, storage, me=["this-machine:1", os.getpid(), 0.0])
    assert recover() == []  # first seen unclaimed now, however old the trial
    time.sleep(1)
    claimed.set_user_attr(WORKER, ["another-machine:1", 4242, 1.0])
    with Heartbeat(storage, claimed._trial_id, interval=1):
        assert recover() == []
        time.sleep(1.5)  # 2.5 s since the first look: past the grace period
        assert recover() == [orphan.number]
    assert study.trials[orphan.number].user_attrs["fail_reason"].startswith("interrupted: no worker claimed it")
    assert [(t.state, t.user_attrs.get(RETRY_OF)) for t in study.trials] == [
        (TrialState.FAIL, None),
        (TrialState.RUNNING, None),
        (TrialState.WAITING, orphan.number),
    ]


# ------------------------------------------------------------------------------------- many workers


@pytest.mark.slow
def test_two_slot_workers_share_one_postgres_study(tmp_path, postgres_url):
    sweep = tmp_path / "sweep"
    args = ["hydra.sweeper.n_trials=4", f"hydra.sweeper.storage={postgres_url}", "hydra.sweeper.devices_per_trial=1"]
    proc = subprocess.run(
        _command(sweep, "parallel=ddp", "gpus=2", *args),
        cwd=tmp_path,
        env=_env(),
        text=True,
        capture_output=True,
        timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "devices_per_trial=1: 2 slot(s) at once (CPU cores " in out
    study = _study(sweep, url=postgres_url)
    ran = [t for t in study.trials if not t.user_attrs.get(SURPLUS)]
    assert len(_counted_finished(study)) == 4 and len(ran) == 4
    assert len({tuple(t.user_attrs[WORKER]) for t in ran}) == 2  # both slot workers took trials
    # no trial ran twice: one launch per trial number across both workers, one directory each
    assert len([line for line in out.splitlines() if "Launching 1 jobs" in line]) == 4
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [str(t.number) for t in ran]
    assert len(_rows(sweep)) == 4


# ------------------------------------------------------------------------------------ config surface
LIGHTNING_TEMPLATE = """# @package _global_

# example hyperparameter optimization of some experiment with Optuna:
# python train.py -m hparams_search=mnist_optuna experiment=example

defaults:
  - override /hydra/sweeper: lychee_optuna

# choose metric which will be optimized by Optuna
optimized_metric: "ndcg@10"

hydra:
  mode: "MULTIRUN" # set hydra to multirun by default if this config is attached

  sweeper:
    # storage URL to persist optimization results
    storage: null
    # name of the study to persist optimization results
    study_name: null
    # number of parallel workers
    n_jobs: 1
    # 'minimize' or 'maximize' the objective
    direction: maximize
    # total number of runs that will be executed
    n_trials: 2
    sampler:
      _target_: optuna.samplers.TPESampler
      seed: 1234
      n_startup_trials: 10 # number of random sampling runs before optimization starts
    params:
      optimizer.lr: interval(0.0001, 0.01)
      data.batch_size: choice(1, 2)
"""


@pytest.mark.slow
def test_a_lightning_hydra_template_search_config_ports_by_its_sweeper_name(tmp_path, capfd, monkeypatch):
    from lychee_exp.run import main

    searchpath = _write_search(tmp_path, "mnist_optuna", LIGHTNING_TEMPLATE)
    # hydra.mode=MULTIRUN in the file: no -m, as in the template
    tiny = [a for a in TINY if not a.startswith("data.batch_size")]  # the file's params drive the search
    argv = ["lychee_exp.run", "hparams_search=mnist_optuna", *tiny, *SINGLE, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    _env_here(monkeypatch)
    # in this process: the behaviour is the config's port (the sweep command line itself: the tests above)
    proc = run_in_process(main, [*argv, searchpath], tmp_path, capfd, monkeypatch, 300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    study = _study(tmp_path / "sweep", name="sweep")  # study_name null: the sweep directory's name
    assert len(_counted_finished(study)) == 2
    assert all(1e-4 <= t.params["optimizer.lr"] <= 1e-2 and t.params["data.batch_size"] in (1, 2) for t in study.trials)
    assert yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())["n_trials"] == 2


BAD_PARAMS = """# @package _global_
defaults:
  - override /hydra/sweeper: lychee_optuna
hydra:
  sweeper:
    direction: maximize
    params:
      {params}
"""


@pytest.mark.parametrize(
    "params, args, expected",
    [
        ("optimizer.lrr: interval(1e-5, 1e-3)", [], "hydra.sweeper.params.optimizer.lrr: 'optimizer.lrr' is not a key"),
        (
            "data.batch_size: choice()",
            [],
            "hydra.sweeper.params.data.batch_size: 'data.batch_size=choice()': "
            "ValueError while evaluating 'choice()': empty choice is not legal",
        ),
        (
            "optimizer.lr: interval(1e-3, 1e-5)",
            [],
            "hydra.sweeper.params.optimizer.lr: interval(0.001, 1e-05) needs low < high",
        ),
        (
            "optimizer.lr: interval(1e-5, 1e-3)",
            ["hydra.sweeper.sampler._target_=optuna.samplers.NoSuchSampler"],
            "hydra.sweeper.sampler._target_=optuna.samplers.NoSuchSampler: no such class",
        ),
        (
            "optimizer.lr: interval(1e-5, 1e-3)",
            ["hydra.sweeper.pruner._target_=optuna.pruners.Nope"],
            "hydra.sweeper.pruner._target_=optuna.pruners.Nope: no such class",
        ),
        (
            "optimizer.lr: interval(1e-5, 1e-3)",
            ["data.batch_size=choice(a,b)"],
            "hydra.sweeper.params: a trial's config does not compose: Error merging override data.batch_size='a'",
        ),
        (
            "optimizer.lr: interval(1e-5, 1e-3)",
            ["hydra.sweeper.direction=minimize"],
            "hydra.sweeper.direction=minimize would minimise optimized_metric=model_ndcg@10",
        ),
        (
            "trial.number: choice(1, 2)",
            [],
            # the trial's identity travels beside the config (tracking.trial.TrialContext): no key to search or set
            "hydra.sweeper.params.trial.number: 'trial.number' is not a key of the composed config",
        ),
        (
            "trainer.global_batch_size: choice(8, 16)",
            ["data.max_tokens_per_batch=4096"],
            "trainer.global_batch_size=8 counts queries per step, but data.max_tokens_per_batch=4096",
        ),
        (
            "trainer.global_tokens_per_step: choice(8192, 16384)",
            [],
            "trainer.global_tokens_per_step=8192 needs a token budget (data.max_tokens_per_batch",
        ),
    ],
    ids=[
        "unknown-key",
        "empty-choice",
        "low-above-high",
        "unknown-sampler",
        "unknown-pruner",
        "wrong-type",
        "minimize",
        "trial-key",
        "global-batch-with-a-budget",
        "global-tokens-without-a-budget",
    ],
)
def test_bad_sweep_configs_get_one_line_before_any_trial(tmp_path, capfd, monkeypatch, params, args, expected):
    # `python -m lychee_exp.run -m ...` run in this process (a process start is seconds of imports); the case
    # below runs as a real process, where anything else on stdout or stderr would show too
    from lychee_exp.run import main

    proc = run_in_process(main, _bad_command(tmp_path, params, args)[2:], tmp_path, capfd, monkeypatch)
    _assert_one_line_before_any_trial(tmp_path, proc, expected)


def test_a_bad_sweep_config_on_a_real_command_line_gets_one_line_before_any_trial(tmp_path):
    command = _bad_command(tmp_path, "optimizer.lrr: interval(1e-5, 1e-3)", [])
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=120)
    _assert_one_line_before_any_trial(tmp_path, proc, "hydra.sweeper.params.optimizer.lrr: 'optimizer.lrr' is not")


def _bad_command(tmp_path: Path, params: str, args: list[str]) -> list[str]:
    searchpath = _write_search(tmp_path, "bad", BAD_PARAMS.format(params=params))
    return [
        sys.executable,
        "-m",
        "lychee_exp.run",
        "-m",
        "hparams_search=bad",
        "model=tiny_lychee",
        "loss=pointwise",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        searchpath,
        *args,
    ]


def _assert_one_line_before_any_trial(tmp_path: Path, proc: subprocess.CompletedProcess, expected: str) -> None:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}") and lines[0] in proc.stderr, lines
    assert not (tmp_path / "sweep").exists()  # no study, no trial


# ------------------------------------------------------------------------------------------------- units
def test_a_trial_context_travels_beside_the_config_to_the_job_s_environment(monkeypatch):
    """The sweeper's override sets LYCHEE_TRIAL while the job runs (Hydra's env_set); the job and its ranks read
    the same context back; the study's URL stays in its own variable, and W&B's record never shows it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from lychee_exp.job.in_process import compose_job
    from lychee_exp.sweep.lychee_trials import STORAGE_ENV, is_lychee_job, trial_context, trial_override
    from lychee_exp.tracking.trial import TRIAL_ENV, current_trial, trial_number

    monkeypatch.delenv(TRIAL_ENV, raising=False)
    assert current_trial() is None and trial_number() == -1  # outside a sweep
    pruner = {"_target_": "optuna.pruners.MedianPruner", "n_warmup_steps": None, "n_startup_trials": 1}
    context = trial_context(3, 17, "it's", pruner, False, {"slots": 2})
    line = trial_override(context, "postgresql://u:secret@host/db")
    assert os.environ.pop(STORAGE_ENV) == "postgresql://u:secret@host/db" and "secret" not in line
    [override] = OverridesParser.create().parse_overrides([line])
    assert override.key_or_group == f"hydra.job.env_set.{TRIAL_ENV}"
    monkeypatch.setenv(TRIAL_ENV, override.value())
    assert current_trial() == context and trial_number() == 3
    assert context.pruner == {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 1}
    assert context.storage == f"env:{STORAGE_ENV}" and "secret" not in str(context.record())
    assert trial_context(3, 17, "s", pruner, True, {}).storage == ""  # multi-objective: never pruned
    assert "trial" not in compose_job([])  # nothing of the trial in the run's config
    assert is_lychee_job(compose_job([]))
    assert not is_lychee_job(OmegaConf.create({"optimized_metric": "x", "trial": {"number": 1}}))


def test_job_outcomes(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from lychee_exp.errors import RunFailed
    from lychee_exp.sweep.lychee_trials import oom_retry_overrides
    from lychee_exp.sweep.outcome import job_outcome

    def job(status, value):
        ret = JobReturn()
        ret.status, ret.return_value = status, value
        return ret

    (tmp_path / "metrics.json").write_text(json.dumps({"ndcg@10": 0.5, "steps": 3, "stopped_early": False}))
    assert job_outcome(job(JobStatus.COMPLETED, 0.5), tmp_path, 1, None).values == [0.5]
    nan = job_outcome(job(JobStatus.COMPLETED, float("nan")), tmp_path, 1, None)
    assert (nan.state, nan.kind) == ("FAIL", "nan")  # a NaN never reaches optuna, nor crashes the sweep
    oom = job_outcome(job(JobStatus.FAILED, RunFailed("rank 1 failed: out of memory", "oom")), tmp_path, 1, None)
    assert (oom.state, oom.reason) == ("FAIL", "oom: rank 1 failed: out of memory")
    crash = job_outcome(job(JobStatus.FAILED, KeyError("x")), tmp_path, 1, None)
    assert crash.reason == "crashed: KeyError: 'x'"
    two = job_outcome(job(JobStatus.COMPLETED, 0.5), tmp_path, 2, ["ndcg@10", "steps"])
    assert (two.state, two.values) == ("COMPLETE", [0.5, 3.0])
    (tmp_path / "metrics.json").write_text(json.dumps({"ndcg@10": 0.25, "stopped_early": True}))
    assert job_outcome(job(JobStatus.COMPLETED, 0.25), tmp_path, 1, None).state == "PRUNED"
    job = OmegaConf.create({"data": {"batch_size": 8}, "trainer": {"grad_accum_steps": 2}})
    assert oom_retry_overrides(["a=1", "data.batch_size=8"], job) == (
        ["a=1", "data.batch_size=4", "trainer.grad_accum_steps=4"],
        {"batch_size": 4, "grad_accum_steps": 4},
    )
    # a searched global batch stays what the trial sampled: only the micro-batch halves (accumulation follows)
    job.trainer.global_batch_size = 16
    assert oom_retry_overrides(["trainer.global_batch_size=16", "data.batch_size=8"], job) == (
        ["trainer.global_batch_size=16", "data.batch_size=4"],
        {"batch_size": 4, "global_batch_size": 16},
    )
    # a token budget is the micro-batch: it halves instead, with twice the accumulation, or the global tokens kept
    job.trainer.global_batch_size, job.data.max_tokens_per_batch = None, 4096
    assert oom_retry_overrides([], job) == (
        ["data.max_tokens_per_batch=2048", "trainer.grad_accum_steps=4"],
        {"max_tokens_per_batch": 2048, "grad_accum_steps": 4},
    )
    job.trainer.global_tokens_per_step = 16384
    assert oom_retry_overrides(["trainer.global_tokens_per_step=16384"], job) == (
        ["trainer.global_tokens_per_step=16384", "data.max_tokens_per_batch=2048"],
        {"max_tokens_per_batch": 2048, "global_tokens_per_step": 16384},
    )
    job.data.max_tokens_per_batch, job.data.batch_size = None, 1
    assert oom_retry_overrides([], job) is None


def test_params_grammar_to_distributions():
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from lychee_exp.errors import UserError
    from lychee_exp.sweep.space import build_space, render

    config = OmegaConf.create(
        {
            "optimizer": {"lr": 1e-4},
            "data": {"batch_size": 4, "name": "x"},
            "hydra": {"runtime": {"choices": {"model": "tiny"}}},
        }
    )
    space = build_space(
        {"optimizer.lr": "tag(log, interval(1e-5, 1e-3))", "data.batch_size": "range(2, 10, 4)"},
        ["model=choice(a,b)", "data.name=y", "data.batch_size=choice(2,4)"],
        config,
        None,
        OverridesParser.create(),
    )
    d = space.distributions
    assert (d["optimizer.lr"].low, d["optimizer.lr"].high, d["optimizer.lr"].log) == (1e-5, 1e-3, True)
    assert d["data.batch_size"].choices == (2, 4)  # the command line wins over params
    assert d["model"].choices == ("a", "b") and space.fixed == {"data.name": "data.name=y"}
    assert space.overrides({"model": "a b", "x": 1e-05}) == ["data.name=y", "model='a b'", "x=1e-05"]
    assert render({"_target_": "p.Q", "n": [1, None, True]}) == "{_target_:'p.Q',n:[1,null,true]}"
    with pytest.raises(UserError, match="range.*needs start <= stop"):
        build_space({"data.batch_size": "range(5, 1)"}, [], config, None, OverridesParser.create())
    with pytest.raises(UserError, match="log interval needs low > 0"):
        build_space({"optimizer.lr": "tag(log, interval(0, 1))"}, [], config, None, OverridesParser.create())


def test_lr_tokens_is_lr_batch_searching_tokens_per_step(tmp_path):
    """hparams_search=lr_tokens (for token budgets): lr_batch's settings, its global batch fixed to null by a
    null param, the step size searched in tokens; both keys exist in the schema, so build_space accepts them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lychee_exp.sweep.space import build_space

    tokens, batch = _search_and_lr_batch("lr_tokens")
    sweeper = tokens.hydra.sweeper
    assert sweeper.study_name == "lr_tokens" and sweeper.pruner == batch.hydra.sweeper.pruner
    assert sweeper.n_trials == batch.hydra.sweeper.n_trials and sweeper.oom_retry is True
    space = build_space(sweeper.params, [], tokens, None, OverridesParser.create())
    assert space.fixed == {"trainer.global_batch_size": "trainer.global_batch_size=null"}
    assert sorted(space.distributions) == ["optimizer.lr", "trainer.global_tokens_per_step"]
    assert space.distributions["trainer.global_tokens_per_step"].choices == (65536, 131072, 262144)


def test_the_recipe_search_is_lr_batch_over_the_recipes_keys(tmp_path):
    """hparams_search=recipe (how data=beir's recipe was chosen): lr_batch's settings over the lr, the run's
    length, distillation, group size, warmup and weight decay of data=beir's bi-encoder, the default job's
    effective batch fixed, the objective the model alone (no mix); build_space accepts them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lychee_exp.sweep.space import build_space

    recipe, batch = _search_and_lr_batch("recipe")
    sweeper = recipe.hydra.sweeper
    assert sweeper.study_name == "recipe" and sweeper.pruner._target_ == batch.hydra.sweeper.pruner._target_
    assert recipe.model.kind == "bi_encoder" and recipe.data.name == "beir"
    assert recipe.data.teacher_weight == 0 and recipe.data.first_stage_weight == 0  # the model alone
    assert recipe.trainer.eval_every > 0  # dev evaluations the pruner can act on
    space = build_space(sweeper.params, [], recipe, None, OverridesParser.create())
    assert space.fixed == {"trainer.global_batch_size": "trainer.global_batch_size=8"}
    searched = ["data.train_group_size", "loss.distill_temperature", "loss.distill_weight", "optimizer.lr"]
    searched += ["optimizer.warmup_ratio", "optimizer.weight_decay", "trainer.max_steps"]
    assert sorted(space.distributions) == searched


def _search_and_lr_batch(name: str):
    """conf/config.yaml composed with hparams_search=<name>, and with lr_batch (what the others inherit)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        search = compose("config", [f"hparams_search={name}"], return_hydra_config=True)
        batch = compose("config", ["hparams_search=lr_batch"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    return search, batch
