"""Beyond one process tree: SLURM variables, two "nodes" on 127.0.0.1 (torchrun agents, faked SLURM nodes),
a node that dies, preemption (signal -> checkpoint -> requeue -> same run) and damaged checkpoints."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_RANKS

from lychee_exp.core.devices import available_cores
from lychee_exp.core.errors import Preempted, RunFailed, UserError
from lychee_exp.launch.cluster import expand_nodelist, is_main_process, job_devices, slurm_nodes
from lychee_exp.launch.processes import free_port
from lychee_exp.testing.baselines import seed_baseline
from lychee_exp.testing.equivalence import assert_same_training
from lychee_exp.testing.jobs import run_job

REPO = Path(__file__).resolve().parent.parent
# The tiny Lychee model, fp32, as tests/test_ddp.py: 2 ranks x batch 2 on any launch path must agree.
TINY_MULTI = [
    *TINY_RANKS,
    "data.random_negatives=0",
    "data.batch_size=2",
    "optimizer.lr=1e-3",
    "trainer.save_model=false",
]


def _losses(run_dir: Path) -> list[float]:
    with (run_dir / "metrics.csv").open() as handle:
        return [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.pop("PYTHONWARNINGS", None)
    return {**env, "HYDRA_FULL_ERROR": "0", **extra}


def _start_until_step_2(args: list[str], cwd: Path, rank0_logs: str, timeout_s: float) -> subprocess.Popen:
    """`python -m lychee_exp.run <args>`, returned once rank 0's log (the glob under cwd) shows step 2."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=cwd,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout_s
    while not any("step 2/" in p.read_text() for p in cwd.glob(rank0_logs)):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    return proc


def _slurm_node(node: int, port: int, args: list[str], cwd: Path) -> subprocess.Popen:
    """One task of a faked 2-node SLURM step: the variables srun would set, both "hosts" being 127.0.0.1."""
    env = _env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_NTASKS="2",
        SLURM_NODEID=str(node),
        SLURM_PROCID=str(node),
        SLURM_LOCALID="0",
        SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1",
        MASTER_PORT=str(port),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="module")
def in_process_ddp(tmp_path_factory) -> Path:
    """The reference: parallel=ddp gpus=2 launched in-process."""
    run_dir = tmp_path_factory.mktemp("ddp")
    run_job([*TINY_MULTI, "parallel=ddp", "gpus=2", "trainer.measure_speedup=false"], run_dir)
    return run_dir


def _assert_same_training(run_dir: Path, reference: Path) -> None:
    got, want = _metrics(run_dir), _metrics(reference)
    assert got["num_devices"] == want["num_devices"] == 2 and got["steps"] == 4
    assert _losses(run_dir) == pytest.approx(_losses(reference), abs=1e-5)
    # every step's pre-clip gradient norm too: a gradient off by a constant factor leaves the losses alone
    assert_same_training(run_dir, reference, weights=False)
    for key in ("initial_ndcg@10", "ndcg@10", "mrr@10"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key


# ------------------------------------------------------------------------------------------ SLURM variables
def test_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_slurm_variables_give_the_node_spec():
    env = {
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[10-13]",
    }
    spec = slurm_nodes(env)
    assert (spec.nnodes, spec.node_rank, spec.endpoint) == (4, 2, "gpu10:20123")
    assert spec.run_id == "slurm-123-0" and spec.node_name(1) == "node 1 (gpu11)"
    assert not is_main_process(env) and is_main_process({**env, "SLURM_NODEID": "0"})
    assert slurm_nodes({**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1"}) is None  # one node: local launch
    assert slurm_nodes({}) is None
    with pytest.raises(UserError, match="one task per node"):
        slurm_nodes({**env, "SLURM_NTASKS": "32"})
    # the job's devices, for trainer.global_batch_size before any rank joins: every node's, or torchrun's world
    assert job_devices(8, env) == 32 and job_devices(8, {}) == 8
    torchrun = {"TORCHELASTIC_RUN_ID": "r", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "16"}
    assert job_devices(2, torchrun) == 16


def test_errors_survive_pickling():
    """submitit hands a job's exception back to the sweeper by pickle: the failure kind must come with it."""
    import pickle

    for err in (RunFailed("rank 1 failed: x", "oom"), Preempted("stopped", "preempted")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.kind == err.kind


def test_requeue_pins_the_run_directory():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra_plugins.lychee_submitit_launcher.launchers import requeue_overrides

    got = requeue_overrides(["gpus=2", "trainer.resume=never", "hydra.sweep.dir=x"], "/runs/a b")
    assert got == ["gpus=2", "hydra.sweep.dir='/runs/a b'", "trainer.resume=auto"]


# ------------------------------------------------------------------------------------------- two "nodes"
def test_two_torchrun_agents_match_in_process_ddp(tmp_path, in_process_ddp, monkeypatch):
    """Also the speedup baseline phase in ranks torchrun started: it runs (nothing cached) and leaves the
    training equal to the in-process run's, which had it off."""
    run_dir, port = tmp_path / "run", free_port()
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(tmp_path / "baselines.json"))
    args = [*TINY_MULTI, f"hydra.run.dir={run_dir}"]
    args += ["trainer.global_batch_size=4"]  # 2 x 2 ranks over both agents: accumulation 1, as the reference
    agents = [
        subprocess.Popen(
            ["bash", str(REPO / "launch/torchrun.sh"), *args],
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_env(
                NNODES="2",
                NODE_RANK=str(k),
                GPUS_PER_NODE="1",
                RUN_ID="two-agents",
                MASTER_PORT=str(port),
                PYTHON=sys.executable,
            ),
        )
        for k in range(2)
    ]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], [out[-3000:] for out in outputs]
    _assert_same_training(run_dir, in_process_ddp)
    m = _metrics(run_dir)
    # one rank per agent: each takes the share of the cores the in-process rule gives one local rank
    assert m["cpu_threads_per_rank"] == available_cores()
    # nothing cached: rank 0 timed one device itself; a figure, or the reason there is none, on one line
    assert m["baseline_samples_per_s"] > 0 and ("speedup" in m) == (m["speedup_status"] == "measured")
    assert m.get("speedup", 0.0) <= 2 and m["speedup_status"].startswith(("measured", "unreliable"))
    assert sum("samples/s on 2 device(s)" in line and "speedup" in line for line in outputs[0].splitlines()) == 1


def test_faked_slurm_nodes_match_in_process_ddp(tmp_path, in_process_ddp, monkeypatch):
    run_dir, port = tmp_path / "run", free_port()
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(tmp_path / "baselines.json"))
    args = [
        *TINY_MULTI,
        "parallel=ddp",
        "gpus=1",
        "parallel.cpu_threads_per_rank=1",
        f"hydra.run.dir={run_dir}",
        "trainer.global_batch_size=4",  # counted over both nodes' ranks: accumulation 1, as the reference
    ]
    seed_baseline(args, run_dir, 1000.0)  # a cached one-device figure: the ranks divide by it, measure none
    nodes = [_slurm_node(k, port, args, tmp_path) for k in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [out[-3000:] for out in outputs]
    _assert_same_training(run_dir, in_process_ddp)
    m = _metrics(run_dir)
    assert m["num_processes"] == 2 and m["cpu_threads_per_rank"] == 1
    assert m["speedup"] == pytest.approx(m["train_samples_per_s"] / 1000.0)  # the cached baseline


def test_a_killed_node_ends_the_other_with_one_line(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    args = [
        *TINY_MULTI,
        "parallel=ddp",
        "gpus=1",
        "parallel.cpu_threads_per_rank=1",
        "trainer.max_steps=100000",
        "trainer.evaluate=false",
        "trainer.measure_speedup=false",
        f"hydra.run.dir={run_dir}",
    ]
    nodes = [_slurm_node(k, port, args, tmp_path) for k in range(2)]
    deadline = time.monotonic() + 240
    log = run_dir / "logs"
    while not any("step 2/" in p.read_text() for p in log.glob("**/0/stderr.log")):
        assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "training did not start"
        time.sleep(0.3)
    nodes[1].send_signal(signal.SIGKILL)  # node 1's agent; its rank dies with it
    killed = time.monotonic()
    out, _ = nodes[0].communicate(timeout=120)
    elapsed = time.monotonic() - killed
    print(f"node 0 ended {elapsed:.1f} s after node 1's agent was killed")  # the figure, with pytest -s
    assert elapsed < 60
    assert nodes[0].returncode == 1
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "lost node 1 (127.0.0.1)" in errors[0], out[-3000:]
    assert "Traceback" not in out and not (run_dir / "metrics.json").exists()


# ------------------------------------------------------------------------------ preemption and checkpoints
def test_damaged_latest_checkpoint_resumes_from_the_previous_one(tmp_path, caplog):
    args = [
        *TINY_MULTI,
        "parallel=single",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=3",
        "trainer.measure_speedup=false",
    ]
    run_job([*args, "trainer.max_steps=4"], tmp_path)
    state = tmp_path / "checkpoints" / "step_000004" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # truncated, as by a dying node
    with caplog.at_level("INFO"):
        run_job([*args, "trainer.max_steps=6", "trainer.resume=auto"], tmp_path)
    reports = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(reports) == 1 and "step_000004" in reports[0] and "\n" not in reports[0]
    assert any("resumed from" in r.getMessage() and "step_000002 at step 2 " in r.getMessage() for r in caplog.records)
    assert _metrics(tmp_path)["steps"] == 6


@pytest.mark.slow
def test_signal_stops_with_a_checkpoint_and_resume_finishes(tmp_path):
    run_dir = tmp_path / "run"
    train = [*TINY_MULTI, "parallel=ddp", "gpus=2", "trainer.max_steps=30", "trainer.measure_speedup=false"]
    proc = _start_until_step_2([*train, f"hydra.run.dir={run_dir}"], tmp_path, "run/logs/**/0/stderr.log", 180)
    proc.send_signal(signal.SIGUSR2)  # what SLURM/submitit send before the time limit or on preemption
    out, _ = proc.communicate(timeout=120)
    errors = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode == 1 and len(errors) == 1 and "trainer.resume=auto" in errors[0], out[-3000:]
    stopped = torch.load(max((run_dir / "checkpoints").glob("step_*")) / "state.pt", weights_only=True)
    assert 2 <= stopped["step"] < 30 and not (run_dir / "metrics.json").exists()
    # the resume in this process (the CLI's exit and line were checked above; a run's CLI in the other tests)
    run_job([*train, "trainer.resume=auto"], run_dir)
    resumed = [p.read_text() for p in run_dir.glob("logs/**/0/stderr.log") if "resumed from" in p.read_text()]
    assert len(resumed) == 1 and f"at step {stopped['step']} " in resumed[0], resumed
    assert _metrics(run_dir)["steps"] == 30


@pytest.mark.slow
def test_slurm_local_job_is_requeued_and_finishes_the_same_run(tmp_path):
    """submitit's own path: USR2 to the job -> checkpoint -> launcher.checkpoint() -> requeue (the local
    executor re-runs the pickled job, as SLURM would) -> the same run directory resumes to max_steps."""
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "hydra/launcher=slurm_local",
        *TINY_MULTI,
        "parallel=ddp",
        "gpus=2",
        "trainer.max_steps=60",
        "trainer.measure_speedup=false",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = _start_until_step_2(args, tmp_path, "sweep/0/logs/**/0/stderr.log", timeout_s=240)
    [controller] = [int(p.name) for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    [task] = [c for c in psutil.Process(controller).children() if "submitit.core._submit" in " ".join(c.cmdline())]
    task.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    job_log = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.*"))
    assert "Requeued job" in job_log and "resumed from" in (sweep / "0" / "run.log").read_text()
    assert _metrics(sweep / "0")["steps"] == 60


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
        env=_env(LYCHEE_FAULT="1:2:raise:2"),
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
        m = _metrics(sweep / str(trial.number))
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
    env = _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        SLURM_ARRAY_TASK_ID="0",
        SLURM_ARRAY_TASK_MIN="0",
        LYCHEE_STORAGE=f"sqlite:///{tmp_path / 'study.db'}",
    )
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "launch/slurm/sweep_array.sbatch"),
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
    assert (sweep / "0" / "metrics.json").is_file() and _metrics(sweep / "0")["num_devices"] == 2
    refused = subprocess.run(
        ["bash", str(REPO / "launch/slurm/sweep_array.sbatch")],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        check=False,
        env={**env, "LYCHEE_STORAGE": "postgresql+psycopg2://u:secret@db/optuna"},
    )
    assert refused.returncode == 2 and "password" in refused.stderr and "secret" not in refused.stderr
