"""Trials in flight (hydra.sweeper.n_jobs): with hydra-submitit-launcher each trial is its own submitit job and
up to n_jobs run at once, a slot taking the next trial as soon as its trial ends; other launchers get batches;
the basic launcher runs trials one at a time. The app (tests/sweep_apps/sleepy.py) stamps when each job ran.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from hydra_in_process import run_in_process
from optuna.trial import TrialState

from lychee_exp.sweep.placement import launch_mode
from lychee_exp.sweep.trials import Pending, TrialRunner, TrialSettings

APPS = Path(__file__).resolve().parent / "sweep_apps"
UNTIL_4 = "until=[0/started,1/started,2/started,3/started]"


@pytest.fixture
def sleepy(tmp_path, capfd, monkeypatch):
    """sleepy(*args): `python tests/sweep_apps/sleepy.py -m <args>` in tmp_path, run in this process (a process
    start is seconds of imports); cli=True: as a real process, as a user runs it (trials in flight under
    submitit, end to end). Asserts the exit code (0 unless `code`); -> (the run, its wall time)."""
    monkeypatch.syspath_prepend(str(APPS))  # as `python sleepy.py` has it: claim_checking_sampler imports

    def sleepy(*args: str, cli: bool = False, code: int = 0) -> tuple[subprocess.CompletedProcess, float]:
        argv = [str(APPS / "sleepy.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]
        began = time.monotonic()
        if cli:
            env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
            command = [sys.executable, *argv]
            proc = subprocess.run(command, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=240)
        else:
            script = lambda: runpy.run_path(argv[0], run_name="__main__")  # noqa: E731
            proc = run_in_process(script, argv, tmp_path, capfd, monkeypatch)
        assert proc.returncode == code, (proc.stdout + proc.stderr)[-3000:]
        return proc, time.monotonic() - began

    return sleepy


def _stamps(tmp_path: Path) -> dict[int, dict]:
    """Trial number -> the job's own {start, end, pid}."""
    stamps = {}
    for path in (tmp_path / "sweep").glob("*/stamps.json"):
        stamps[int(path.parent.name)] = json.loads(path.read_text())
    return stamps


def _max_overlap(stamps: dict[int, dict]) -> int:
    """The most jobs running at one instant (a job's start is such an instant when the most overlap)."""
    return max(sum(1 for o in stamps.values() if o["start"] <= s["start"] < o["end"]) for s in stamps.values())


@pytest.mark.slow
def test_submitit_local_runs_n_jobs_trials_at_once(sleepy, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    # each trial waits until all four have started (at most 120 s): at once, however slow the starts
    proc, wall = sleepy("hydra/launcher=submitit_local", "hydra.sweeper.n_jobs=4", "sleep_s=120", UNTIL_4, cli=True)
    stamps = _stamps(tmp_path)
    assert sorted(stamps) == [0, 1, 2, 3] and len({s["pid"] for s in stamps.values()}) == 4  # 4 job processes
    assert _max_overlap(stamps) >= 3, stamps
    study = optuna.load_study(study_name="sleepy", storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert any("up to 4 trials at once" in line for line in proc.stdout.splitlines())
    print(f"4 trials, n_jobs=4, submitit_local: {wall:.1f} s wall, {_max_overlap(stamps)} at once")


@pytest.mark.slow
def test_a_slot_takes_the_next_trial_as_soon_as_its_trial_ends(sleepy, tmp_path):
    # trial 0 runs until trial 2 has ended (at most 120 s), the others 1 s: with n_jobs=2, trials 1 and 2 run in
    # the second slot while trial 0 still runs (in batches of 2, trial 2 would wait for trial 0's 120 s)
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sleepy(
        "hydra/launcher=submitit_local",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.n_trials=3",
        "first_s=120",
        "sleep_s=1",
        "until=[2/stamps.json]",
    )
    stamps = _stamps(tmp_path)
    assert sorted(stamps) == [0, 1, 2]
    assert stamps[1]["end"] <= stamps[2]["start"] < stamps[0]["end"], stamps


@pytest.mark.slow
def test_the_failure_rate_stops_new_trials_and_waits_for_those_in_flight(sleepy, tmp_path):
    # n_trials=4, rate 0.25: the sweep stops at 2 failures; trial 0 runs until trial 2 (the second failure) has
    # ended (at most 120 s; a fixed 12 s once ended first on a loaded machine): it is waited for and recorded, and
    # no 4th trial starts
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = ["hydra/launcher=submitit_local", "hydra.sweeper.n_jobs=2", "hydra.sweeper.max_failure_rate=0.25"]
    proc, _ = sleepy(*args, "first_s=120", "sleep_s=0.5", "until=[2/stamps.json]", "fail=true", code=1)
    study = optuna.load_study(study_name="sleepy", storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 3
    assert study.trials[0].user_attrs["fail_reason"] == "crashed: RuntimeError: job 0 fails on purpose"
    stamps = _stamps(tmp_path)
    assert stamps[2]["end"] < stamps[0]["end"]  # trial 2 failed (the second failure) while trial 0 ran
    [error] = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "3 trials failed, more than max_failure_rate=0.25 x n_trials=4" in error


@pytest.mark.slow
def test_sigkill_with_trials_in_flight_then_the_same_command_finishes_the_study(sleepy, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    command = [sys.executable, str(APPS / "sleepy.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    command += ["hydra/launcher=submitit_local", "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=2"]
    # the trials run until the test writes `release` (at most 120 s): both are surely in flight at the kill
    command += ["hydra.sweeper.heartbeat_interval=1", "sleep_s=120", "until=[release]"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    storage, deadline = f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}", time.monotonic() + 120
    while True:  # both trials in flight
        assert proc.poll() is None and time.monotonic() < deadline, "two trials never ran at once"
        try:
            trials = optuna.load_study(study_name="sleepy", storage=storage).trials
        except Exception:  # no study yet
            trials = []
        if [(t.state, "worker" in t.user_attrs) for t in trials] == [(TrialState.RUNNING, True)] * 2:
            break  # both claimed by the sweeper (an unclaimed trial is the next test's case)
        time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=30)
    (tmp_path / "sweep" / "release").touch()
    sleepy(*command[4:])
    study = optuna.load_study(study_name="sleepy", storage=storage)
    states = [(t.state, t.user_attrs.get("interrupted", False), t.user_attrs.get("retry_of")) for t in study.trials]
    assert states == [
        (TrialState.FAIL, True, None),
        (TrialState.FAIL, True, None),
        (TrialState.COMPLETE, False, 0),
        (TrialState.COMPLETE, False, 1),
    ] or states == [
        (TrialState.FAIL, True, None),
        (TrialState.FAIL, True, None),
        (TrialState.COMPLETE, False, 1),
        (TrialState.COMPLETE, False, 0),
    ]
    assert all("worker process is gone" in t.user_attrs["fail_reason"] for t in study.trials[:2])
    assert {t.params["x"] for t in study.trials[2:]} == {t.params["x"] for t in study.trials[:2]}


def test_a_sweep_killed_before_it_claimed_its_trial_is_finished_by_the_same_command(sleepy, tmp_path):
    # the killed worker's study.ask() left trial 0 RUNNING, with neither heartbeat nor worker (optuna never finds
    # it stale): the re-run recovers it after the grace period instead of waiting for it forever
    storage = f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}"
    (tmp_path / "sweep").mkdir()
    optuna.create_study(storage=storage, study_name="sleepy").ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    overrides = ["hydra.sweeper.n_trials=1", "sleep_s=0", "hydra.sweeper.heartbeat_interval=1"]
    sleepy(*overrides, "hydra.sweeper.grace_period=2")  # a hang: run_in_process's timeout
    study = optuna.load_study(study_name="sleepy", storage=storage)
    assert [(t.state, t.user_attrs.get("retry_of")) for t in study.trials] == [
        (TrialState.FAIL, None),
        (TrialState.COMPLETE, 0),
    ]
    assert "no worker claimed it within 2 s" in study.trials[0].user_attrs["fail_reason"]


def test_the_sampler_draws_after_the_worker_has_claimed_the_trial(sleepy, tmp_path):
    # other workers fail a trial left unclaimed for grace_period: a slow sampler must not leave it so
    sampler = "hydra.sweeper.sampler._target_=claim_checking_sampler.ClaimCheckingSampler"
    sleepy("hydra.sweeper.n_trials=2", "sleep_s=0", sampler)
    study = optuna.load_study(study_name="sleepy", storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2 and all("x" in t.params for t in study.trials)


def test_the_same_command_on_a_finished_study_runs_no_trial(sleepy, tmp_path):
    # n_trials is the study's total: running the finished sweep's command again adds nothing and rewrites no run
    sleepy("hydra.sweeper.n_trials=2", "sleep_s=0")
    stamps = {p: p.read_text() for p in (tmp_path / "sweep").glob("*/stamps.json")}
    sleepy("hydra.sweeper.n_trials=2", "sleep_s=0")
    study = optuna.load_study(study_name="sleepy", storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2 and len(stamps) == 2
    assert {p: p.read_text() for p in (tmp_path / "sweep").glob("*/stamps.json")} == stamps


@pytest.mark.slow
def test_two_workers_with_two_slots_each_share_one_postgres_study(tmp_path, postgres_url):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    command = [sys.executable, str(APPS / "sleepy.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    command += ["hydra/launcher=submitit_local", "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=6"]
    # trials 0-2 (the first four trials take all four slots) each run until all three have started (at most
    # 120 s): three at once needs both workers' slots; the others end as soon as they have started
    command += ["sleep_s=120", "until=[0/started,1/started,2/started]"]
    command += [f"hydra.sweeper.storage={postgres_url}", "hydra.sweeper.sampler.seed=1"]
    workers = []
    for worker in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0", LYCHEE_SWEEP_WORKER=str(worker))
        log = (tmp_path / f"worker_{worker}.log").open("w")
        workers.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [w.wait(timeout=300) for w in workers]
    logs = [(tmp_path / f"worker_{worker}.log").read_text() for worker in range(2)]
    assert codes == [0, 0], [log[-2000:] for log in logs]
    study = optuna.load_study(study_name="sleepy", storage=postgres_url)
    ran = [t for t in study.trials if not t.user_attrs.get("surplus")]
    assert len(ran) == 6 and all(t.state == TrialState.COMPLETE for t in ran)
    assert len({tuple(t.user_attrs["worker"]) for t in ran}) == 2  # both workers took trials
    stamps = _stamps(tmp_path)
    assert sorted(stamps) == sorted(t.number for t in ran)  # each trial ran once, in its own directory
    assert _max_overlap(stamps) >= 3  # more than one worker's slots at once


def test_the_basic_launcher_runs_trials_one_at_a_time(sleepy, tmp_path):
    proc, _ = sleepy("hydra.sweeper.n_jobs=3", "hydra.sweeper.n_trials=3", "sleep_s=0.5")
    assert _max_overlap(_stamps(tmp_path)) == 1
    [line] = [line for line in proc.stdout.splitlines() if "n_jobs=3" in line]
    assert "BasicLauncher runs trials one at a time" in line


def test_launch_mode_per_launcher():
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    submitit = pytest.importorskip("hydra_plugins.hydra_submitit_launcher.submitit_launcher")
    from hydra_plugins.lychee_submitit_launcher.launchers import RequeueingLocalLauncher

    class JoblibLike:  # any other launcher: it runs a batch at once, but may not be called from threads
        pass

    assert launch_mode(BasicLauncher(), 4) == "one"
    assert launch_mode(object.__new__(submitit.LocalLauncher), 1) == "one"
    assert launch_mode(object.__new__(submitit.LocalLauncher), 2) == "slots"
    assert launch_mode(object.__new__(submitit.SlurmLauncher), 2) == "slots"
    assert launch_mode(object.__new__(RequeueingLocalLauncher), 2) == "slots"
    assert launch_mode(JoblibLike(), 3) == "batch"


def test_a_batch_is_one_launch_call_and_each_trial_gets_its_own_return(tmp_path):
    calls = []

    class Launcher:
        def launch(self, jobs, initial_job_idx):
            calls.append((len(jobs), initial_job_idx))
            returns = []
            for job in jobs:
                ret = JobReturn()
                x = float(next(line for line in job if line.startswith("x=")).split("=")[1])
                ret.status, ret.return_value = (
                    (JobStatus.COMPLETED, x) if x >= 0 else (JobStatus.FAILED, ValueError("x"))
                )
                returns.append(ret)
            return returns

    study = optuna.create_study()
    batch = []
    for number, x in enumerate([1.0, -1.0, 2.0]):
        trial = study.ask()
        batch.append(Pending(trial, number, [f"x={x}"], str(number)))
    TrialRunner(TrialSettings(Launcher(), tmp_path)).execute_batch(batch)
    assert calls == [(3, 0)]
    assert [(p.outcome.state, p.outcome.values) for p in batch] == [
        ("COMPLETE", [1.0]),
        ("FAIL", None),
        ("COMPLETE", [2.0]),
    ]
    assert batch[1].outcome.reason == "crashed: ValueError: x"


def test_oom_retries_of_two_trials_in_flight_run_in_their_own_slots(tmp_path):
    """Two slot threads at once, each trial out of memory once: each retries in `<number>-oom-retry` with half
    the batch, and the retry's result is the trial's."""
    import threading

    from omegaconf import OmegaConf

    from lychee_exp.errors import RunFailed

    launched, lock = [], threading.Lock()

    class Launcher:
        def launch(self, jobs, initial_job_idx):
            [job] = jobs
            with lock:
                launched.append(job[-1])
            time.sleep(0.2)  # both trials' first attempts overlap
            ret = JobReturn()
            if "data.batch_size=1" in job:
                ret.status, ret.return_value = JobStatus.COMPLETED, 0.5
            else:
                ret.status, ret.return_value = JobStatus.FAILED, RunFailed("rank 0: out of memory", "oom")
            return [ret]

    class Loader:
        def load_sweep_config(self, config, overrides):
            return OmegaConf.create({"data": {"batch_size": 2}, "trainer": {"grad_accum_steps": 1}})

    study = optuna.create_study(direction="maximize")
    runner = TrialRunner(TrialSettings(Launcher(), tmp_path, oom_retry=True, lychee=True, config_loader=Loader()))
    pending = [Pending(study.ask(), n, ["data.batch_size=2"], str(n)) for n in range(2)]
    threads = [threading.Thread(target=runner.execute, args=(p,)) for p in pending]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(launched) == [f"hydra.sweep.subdir={n}{s}" for n in range(2) for s in ("", "-oom-retry")]
    for p in pending:
        assert (p.outcome.state, p.outcome.values) == ("COMPLETE", [0.5])
        assert p.trial.user_attrs["oom_retry"] == {"batch_size": 1, "grad_accum_steps": 2}
        assert p.trial.user_attrs["run_dir"] == str(tmp_path / f"{p.trial.number}-oom-retry")
