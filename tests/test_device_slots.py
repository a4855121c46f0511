"""hydra.sweeper.devices_per_trial: N runs floor(D / N) trials at once, each slot on its own devices (disjoint
CUDA_VISIBLE_DEVICES shares, or its own CPU cores), all in one study that a re-run finishes after a kill; auto
picks N from measured speedups by wall(n) = ceil(T / floor(D/n)) * t / s(n)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from lychee_exp.errors import UserError
from lychee_exp.sweep.placement import (
    Devices,
    candidates,
    decide,
    machine_devices,
    parse,
    plan_slots,
    run_slots,
    slot_env,
    wall_time,
)

APPS = Path(__file__).resolve().parent / "sweep_apps"
TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2


def _sleepy(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, str(APPS / "sleepy.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")


def _stamps(tmp_path: Path) -> dict[int, dict]:
    return {int(p.parent.name): json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/stamps.json")}


def _study(tmp_path: Path, name: str = "sleepy") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")


def test_gpu_shares_are_disjoint_and_each_slot_process_gets_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    devices = machine_devices(cuda_count=4)  # a faked GPU count: the ids are the visible ones
    assert devices == Devices("cuda", ("3", "5", "6", "7"))
    slots = plan_slots(devices, 4, 2)
    assert [s.ids for s in slots] == [("3", "5"), ("6", "7")]
    assert [len(s.ids) for s in plan_slots(devices, 4, 1)] == [1] * 4 and len(plan_slots(devices, 3, 2)) == 1
    if TWO_CORES:  # GPU slots split the cores too, so that their ranks' threads do not compete
        two = plan_slots(devices, 4, 2)
        assert two[0].cores and two[1].cores and not set(two[0].cores) & set(two[1].cores)
    cpu = plan_slots(Devices("cpu", ("0", "1", "2", "3")), 4, 2)
    assert [s.cores for s in cpu] == [(0, 1), (2, 3)]
    # the real spawner: each slot's process sees its own share, and the slots run at once
    probe = (
        "import json, os, sys, time; t = time.time(); time.sleep(1.5); "
        "json.dump({'cuda': os.environ['CUDA_VISIBLE_DEVICES'], 'slot': os.environ['LYCHEE_SWEEP_SLOT'], "
        "'start': t, 'end': time.time()}, open(os.path.join(sys.argv[1], os.environ['LYCHEE_SWEEP_SLOT']), 'w'))"
    )
    codes = run_slots(plan_slots(devices, 4, 1), [sys.executable, "-c", probe, str(tmp_path)])
    assert codes == [0] * 4
    seen = [json.loads((tmp_path / str(i)).read_text()) for i in range(4)]
    assert [s["cuda"] for s in seen] == ["3", "5", "6", "7"]
    assert max(s["start"] for s in seen) < min(s["end"] for s in seen)  # all four at once
    assert slot_env(slots[1], {"LYCHEE_SWEEP_WORKER": "2"})["LYCHEE_SWEEP_WORKER"] == "2001"  # own sampler seed


def test_auto_minimises_the_expected_wall_time():
    speedups = {1: 1.0, 2: 1.93, 4: 3.41, 8: 6.1}
    # 100 trials on 8 devices: 4 slots of 2 beat 8 of 1 and 1 of 8 (13 and 16.4 trial-times against 12.95)
    assert wall_time(2, 1.93, 8, 100) == pytest.approx(25 / 1.93)
    choice = decide(speedups, 8, 100)
    assert (choice.devices_per_trial, choice.slots) == (2, 4)
    assert choice.gain == pytest.approx((100 / 6.1) / (25 / 1.93))
    assert "devices_per_trial=2: 4 slot(s); speedup 1.00x at 1, 1.93x at 2, 3.41x at 4, 6.10x at 8" in choice.line()
    assert decide(speedups, 8, 1).devices_per_trial == 8  # one trial left: all devices on it
    assert decide({1: 1.0, 2: 2.0}, 2, 10).devices_per_trial == 2  # linear scaling: a tie goes to all devices
    assert decide({1: 1.0, 2: 0.8}, 2, 10).devices_per_trial == 1  # a trial slower on two: one per device
    assert candidates(8) == [1, 2, 4, 8] and candidates(6) == [1, 2, 3, 6]


BAD_SETTING = "error: hydra.sweeper.devices_per_trial={}: use all, auto or a positive number of devices"


@pytest.mark.parametrize("value", ["0", "many", "-1"])
def test_a_bad_devices_per_trial_is_refused_with_one_line(value):
    with pytest.raises(UserError) as refused:
        parse(value)
    assert f"error: {refused.value}" == BAD_SETTING.format(value)


def test_a_bad_devices_per_trial_is_one_line_before_any_trial(tmp_path):
    """The command line's side of the refusal above (one value: the others take the same path)."""
    proc = subprocess.run(
        _sleepy(tmp_path, "hydra.sweeper.devices_per_trial=many"),
        cwd=tmp_path,
        env=_env(),
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [BAD_SETTING.format("many")]
    assert not _stamps(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CORES, reason="needs 2 cores")
def test_one_device_per_trial_runs_two_trials_at_once_on_their_own_cores(tmp_path):
    # trials 0 and 1 (one per slot: no slot is free before one of them ends) each run until both have started
    # (at most 120 s); trials 2 and 3 end as soon as they start
    args = [
        "hydra.sweeper.devices_per_trial=1",
        "hydra.sweeper.n_trials=4",
        "sleep_s=120",
        "until=[0/started,1/started]",
    ]
    proc = subprocess.run(
        _sleepy(tmp_path, *args), cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    stamps = _stamps(tmp_path)
    assert sorted(stamps) == [0, 1, 2, 3]
    # two slot workers, each on one core of its own, their trials overlapping in time
    by_core = {}
    for s in stamps.values():
        assert len(s["cores"]) == 1
        by_core.setdefault(s["cores"][0], set()).add(s["pid"])
    assert len(by_core) == 2 and all(len(pids) == 1 for pids in by_core.values())
    first = sorted(stamps.values(), key=lambda s: s["start"])
    assert first[1]["start"] < first[0]["end"], "the first two trials did not overlap"
    assert [t.state for t in _study(tmp_path).trials] == [TrialState.COMPLETE] * 4
    assert "devices_per_trial=1: 2 slot(s) at once" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CORES, reason="needs 2 cores")
def test_sigkill_of_a_slotted_sweep_then_the_same_command_finishes_the_study(tmp_path):
    # trial 0 ends after 1 s, the others run until the test writes `release` (at most 120 s): when trial 0 is
    # done, the other slot's trial is surely in flight (two trials of one length could end together, and a kill
    # just after both would leave nothing in flight)
    command = _sleepy(tmp_path, "hydra.sweeper.devices_per_trial=1", "hydra.sweeper.n_trials=4", "sleep_s=120")
    command += ["first_s=1", "until=[release]", "hydra.sweeper.heartbeat_interval=1"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while True:  # a trial done, the next in flight
        assert proc.poll() is None and time.monotonic() < deadline, "the slots never got that far"
        try:
            states = [t.state for t in _study(tmp_path).trials]
        except Exception:  # no study yet
            states = []
        if TrialState.COMPLETE in states and TrialState.RUNNING in states:
            break
        time.sleep(0.2)
    proc.kill()  # the slot workers die with it (and leave their trials RUNNING)
    proc.wait(timeout=30)
    (tmp_path / "sweep" / "release").touch()  # the re-run's trials end as soon as they start
    done_before = {t.number for t in _study(tmp_path).trials if t.state == TrialState.COMPLETE}
    runs_before = {n: s["start"] for n, s in _stamps(tmp_path).items()}
    rerun = subprocess.run(command, cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=300)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    trials = _study(tmp_path).trials
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 4 and done_before <= {t.number for t in complete}
    # a finished trial never ran again (its job's own stamp is the one from before the kill)
    assert all(_stamps(tmp_path)[n]["start"] == runs_before[n] for n in done_before)
    interrupted = [t for t in trials if t.state == TrialState.FAIL]
    assert interrupted and all(t.user_attrs.get("interrupted") for t in interrupted)
    assert len(trials) == 4 + len(interrupted)


# lr_batch's search over the effective batch, at its smallest: 2 or 4 micro-steps a step on one device, not 16
SMALL_BATCHES = "trainer.global_batch_size=choice(4,8)"


def _lr_batch(sweep: Path, *args: str) -> str:
    """An lr_batch sweep of 2 tiny trials with devices_per_trial=auto from the command line; -> its output."""
    from conftest import TINY_RANKS

    command = [sys.executable, "-m", "lychee_exp.run", "-m", "hparams_search=lr_batch", *TINY_RANKS]
    command += ["trainer.save_model=false", f"hydra.sweep.dir={sweep}", "hydra.sweeper.n_trials=2"]
    command += ["hydra.sweeper.devices_per_trial=auto", "hydra.sweeper.heartbeat_interval=1", SMALL_BATCHES, *args]
    proc = subprocess.run(command, cwd=sweep.parent, env=_env(), text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, str]:
    """One auto sweep that measures 1 and 2 devices (nothing cached) and runs its trials as it decided;
    -> (its directory, holding its sweep and the cache, and its output)."""
    root = tmp_path_factory.mktemp("auto")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LYCHEE_BASELINE_FILE", str(root / "cache" / "b.json"))
        return root, _lr_batch(root / "first")


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CORES, reason="needs 2 cores")
def test_auto_prints_its_decision_and_records_it(calibrated):
    root, out = calibrated
    (line,) = [line for line in out.splitlines() if "x the trials per hour of 1 x 2" in line]
    assert "speedup 1.00x at 1, " in line and "x at 2 ->" in line
    assert out.count("samples/s (calibrated)") == 2
    summary = (root / "first" / "optimization_results.yaml").read_text()
    assert "setting: auto" in summary and "speedups:" in summary
    assert sorted(p.name for p in (root / "first" / "calibration").iterdir()) == ["1_devices", "2_devices"]
    cached = json.loads((root / "cache" / "scaling.json").read_text())
    assert len(cached) == 2


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CORES, reason="needs 2 cores")
def test_auto_from_the_cache_runs_lr_batch_one_device_per_trial_two_training_trials_at_once(
    calibrated, tmp_path, monkeypatch
):
    """Another sweep of the same settings reads the calibration's figures from the cache (the first sweep's
    entries, their 2-device figure set to 1.5x the 1-device one: it decides one device per trial, and shows that
    it read them), then runs lr_batch's two trials at once, one device each."""
    cache = json.loads((calibrated[0] / "cache" / "scaling.json").read_text())
    (one,) = [key for key in cache if key.endswith("|n=1")]
    (two,) = [key for key in cache if key.endswith("|n=2")]
    cache[two]["samples_per_s"] = 1.5 * cache[one]["samples_per_s"]
    (tmp_path / "scaling.json").write_text(json.dumps(cache))
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(tmp_path / "b.json"))
    sweep = tmp_path / "sweep"
    out = _lr_batch(sweep)
    assert "samples/s (calibrated)" not in out and out.count("samples/s from ") == 2
    assert not (sweep / "calibration").exists()
    (line,) = [line for line in out.splitlines() if "x the trials per hour of 1 x 2" in line]
    assert "devices_per_trial=1: 2 slot(s); speedup 1.00x at 1, 1.50x at 2 ->" in line
    study = _study(tmp_path, "lr_batch")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    a, b = study.trials
    assert a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete  # at once
    assert a.user_attrs["worker"] != b.user_attrs["worker"]  # two slot workers
    for t in study.trials:
        metrics = json.loads((sweep / str(t.number) / "metrics.json").read_text())
        # one device each; the searched effective batch reached by accumulation
        assert metrics["num_devices"] == 1
        assert metrics["effective_batch_size"] == t.params["trainer.global_batch_size"]
        assert metrics["grad_accum_steps"] == t.params["trainer.global_batch_size"] // 2
    summary = (sweep / "optimization_results.yaml").read_text()
    assert "placement:" in summary and "slots: 2" in summary


def test_auto_measures_each_device_count_once_then_reads_the_cache(tmp_path, monkeypatch):
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.job.in_process import compose_job
    from lychee_exp.sweep.placement import cache_path, measured_speedups, store_rate

    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(tmp_path / "b.json"))
    cfg = to_run_config(compose_job(["model=tiny_lychee"], tmp_path))
    measured = []

    def measure(n: int) -> float:
        measured.append(n)
        return {1: 10.0, 2: 15.0, 4: 24.0}[n]

    assert measured_speedups(cfg, "cpu", [2, 4], measure) == {1: 1.0, 2: 1.5, 4: 2.4}
    assert measured_speedups(cfg, "cpu", [1, 2, 4], measure) == {1: 1.0, 2: 1.5, 4: 2.4}
    assert measured == [1, 2, 4] and cache_path(cfg) == tmp_path / "scaling.json"
    # other training settings are other figures; the scaling benchmark's figure for the same settings is reused
    other = to_run_config(compose_job(["model=tiny_lychee", "data.train_group_size=2"], tmp_path))
    store_rate(other, "cpu", 1, 5.0, "bench")
    store_rate(other, "cpu", 2, 9.0, "bench")
    assert measured_speedups(other, "cpu", [2], measure) == {1: 1.0, 2: 1.8} and measured == [1, 2, 4]
