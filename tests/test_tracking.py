"""W&B tracking, observed speedup and the scaling benchmark, all offline. (A DDP run's W&B record:
tests/test_monitoring.py, which reads the same 2-rank run for both loggers.)"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import run_metrics

from lychee_exp.job.in_process import run_job
from lychee_exp.tracking.speedup import SHARED_CPU_SHARE
from lychee_exp.tracking.wandb_records import find_run_files, read_run

TINY = [
    "model=tiny_lychee",
    "loss=pointwise",
    "data.batch_size=2",
    "data.max_train_queries=16",
    "data.max_dev_queries=4",
    "data.train_group_size=4",
    "trainer.max_steps=4",
    "trainer.progress_bar=false",
    "trainer.log_every=1",
    "optimizer.lr=1e-3",
]
SECRET = "0123456789abcdef0123456789abcdef01234567"


def test_unreachable_server_falls_back_offline_and_never_leaks_the_key(tmp_path, no_wandb_key, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lychee_exp.run",
            *TINY,
            "parallel=single",
            "logger=wandb",
            "logger.mode=online",
            "logger.init_timeout_s=3",
            "trainer.checkpoint_every=2",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "continuing offline" in proc.stdout + proc.stderr
    files = find_run_files(run_dir)
    assert len(files) == 1 and "offline-run" in str(files[0])
    assert SECRET not in proc.stdout + proc.stderr
    for path in run_dir.rglob("*"):  # logs, configs, checkpoints, W&B files
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_single_device_speedup_is_one_and_cached_when_the_machine_was_quiet(tmp_path, no_wandb_key, monkeypatch):
    path = tmp_path / "baselines.json"
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(path))
    run_job([*TINY, "parallel=single", "logger=none", "trainer.max_steps=8"], tmp_path / "run")
    m = run_metrics(tmp_path / "run")
    # the run is its own one-device baseline, whatever the load: 1.0 by definition
    assert (m["speedup"], m["scaling_efficiency"], m["speedup_status"]) == (1.0, 1.0, "measured")
    threads = m["cpu_threads_per_rank"]
    assert m["speedup_baseline"] == f"1 device (1 rank x {threads} thread{'s' if threads > 1 else ''}, CPU)"
    cached = json.loads(path.read_text()) if path.exists() else {}
    quiet = m["train_cpu_share"] >= SHARED_CPU_SHARE  # only then is its figure kept for multi-device runs
    assert [entry["samples_per_s"] for entry in cached.values()] == ([m["train_samples_per_s"]] if quiet else [])


def test_bench_prints_table_csv_and_plot(tmp_path, no_wandb_key):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scaling",
            "gpus=2",  # the 1-device row is measured all the same: speedup divides by it
            *TINY,
            "logger=wandb",
            "--steps",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["devices", "samples/s"])
    assert [lines[header + 2].split()[0], lines[header + 3].split()[0]] == ["1", "2"]
    with (out / "bench.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["devices"]) for r in rows] == [1, 2] and float(rows[0]["speedup"]) == 1.0
    measured = float(rows[1]["samples_per_s"]) / float(rows[0]["samples_per_s"])
    assert float(rows[1]["speedup"]) == pytest.approx(measured, rel=1e-3)
    assert all(float(r["samples_per_s"]) > 0 for r in rows)
    assert (out / "bench.png").stat().st_size > 1000
    (bench_run,) = find_run_files(out)
    assert read_run(bench_run)["run"]["job_type"] == "bench"


def test_sweep_trials_are_one_wandb_run_each_in_one_group(tmp_path, no_wandb_key):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lychee_exp.run",
            "-m",
            "hparams_search=lr_batch",
            *TINY,
            "parallel=single",
            "gpus=1",
            "logger=wandb",
            "hydra.sweeper.n_trials=3",
            "data.batch_size=choice(1,2)",
            "trainer.global_batch_size=null",  # the per-device batch searched (lr_batch's own is the global one)
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [read_run(path) for path in find_run_files(sweep_dir)]
    assert len(runs) == 3
    assert {r["run"]["group"] for r in runs} == {"lr_batch"} and {r["run"]["job_type"] for r in runs} == {"trial"}
    with (sweep_dir / "trials.csv").open() as handle:
        trials = {row["number"]: row for row in csv.DictReader(handle)}
    for r in runs:
        number = r["run"]["name"].rsplit("trial", 1)[1]
        assert r["config"]["optimizer"]["lr"] == pytest.approx(float(trials[number]["lr"]))
        assert r["config"]["data"]["batch_size"] == int(trials[number]["per_device_batch_size"])
        assert "env:" in r["config"]["trial"]["storage"]  # the storage URL itself stays out of W&B
