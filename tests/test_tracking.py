"""W&B tracking, observed speedup and the scaling benchmark, all offline."""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lychee_exp.testing.jobs import run_job
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


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _baseline_file(tmp_path: Path) -> str:
    return f"speedup.baseline_file={tmp_path / 'baselines.json'}"


def test_ddp_run_writes_one_offline_wandb_run_matching_metrics(tmp_path, no_wandb_key):
    run_dir = tmp_path / "run"
    run_job([*TINY, "parallel=ddp", "gpus=2", "logger=wandb", "logger.tags=[smoke]", _baseline_file(tmp_path)], run_dir)
    files = find_run_files(run_dir)
    assert len(files) == 1 and "offline-run" in str(files[0])
    record, metrics = read_run(files[0]), _metrics(run_dir)
    assert record["summary"]["effective_batch_size"] == metrics["effective_batch_size"] == 4
    assert record["summary"]["speedup"] == pytest.approx(metrics["speedup"])
    assert record["summary"]["num_devices"] == 2
    assert record["summary"]["dev/ndcg@10"]["max"] == pytest.approx(max(metrics["ndcg@10"], metrics["initial_ndcg@10"]))
    config = record["config"]
    assert config["num_devices"] == 2 and config["effective_batch_size"] == 4 and config["grad_accum_steps"] == 1
    assert config["optimizer"]["lr"] == pytest.approx(1e-3) and config["lr"] == pytest.approx(metrics["lr"])
    assert record["run"]["job_type"] == "train" and record["run"]["group"] == run_dir.name
    assert record["run"]["tags"] == ["smoke"]
    assert [row["train/loss"] for row in record["history"] if "train/loss" in row]  # per-step history


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
            _baseline_file(tmp_path),
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


def test_single_device_speedup_is_one(tmp_path, no_wandb_key):
    first, second = tmp_path / "first", tmp_path / "second"
    single = [*TINY, "parallel=single", "logger=none", "trainer.max_steps=8", _baseline_file(tmp_path)]
    run_job(single, first)
    assert _metrics(first)["speedup"] == 1.0  # no baseline yet: the run is its own
    cached = json.loads((tmp_path / "baselines.json").read_text())
    assert [entry["samples_per_s"] for entry in cached.values()] == [_metrics(first)["train_samples_per_s"]]
    run_job(single, second)  # now measured against the first run's throughput
    m = _metrics(second)
    assert m["baseline_samples_per_s"] == pytest.approx(_metrics(first)["train_samples_per_s"])
    # 1.0 within timing noise; a timing is not asserted, the arithmetic is
    assert m["speedup"] == pytest.approx(m["train_samples_per_s"] / m["baseline_samples_per_s"])
    assert m["speedup_vs_one_rank"] == pytest.approx(m["speedup"])  # one process is one rank
    assert m["scaling_efficiency"] == pytest.approx(m["speedup"])


def by_threads_key(cached: dict, threads: str) -> str:
    return next(key for key in cached if key.endswith(threads))


def test_multi_device_run_calibrates_and_caches_its_baselines(tmp_path, no_wandb_key):
    """2 CPU ranks x 1 thread: `speedup` over ONE process with both threads (the best single process on those
    cores), speedup_vs_one_rank over one rank with one thread; both calibrated and cached by thread count."""
    run_job(
        [*TINY, "parallel=ddp", "gpus=2", "parallel.cpu_threads_per_rank=1", "logger=none", _baseline_file(tmp_path)],
        tmp_path / "run",
    )
    cached = json.loads((tmp_path / "baselines.json").read_text())
    by_threads = {key.rsplit("|", 1)[1]: entry for key, entry in cached.items()}
    assert sorted(by_threads) == ["cpu x1 threads", "cpu x2 threads"]
    assert all(e["source"] == "calibration" for e in cached.values())
    # the single process trains both ranks' queries per step (batch 4), one rank its own (batch 2)
    assert "batch4" in by_threads_key(cached, "cpu x2 threads") and "batch2" in by_threads_key(cached, "cpu x1 threads")
    m = _metrics(tmp_path / "run")
    process, rank = by_threads["cpu x2 threads"]["samples_per_s"], by_threads["cpu x1 threads"]["samples_per_s"]
    assert m["baseline_samples_per_s"] == pytest.approx(process)
    assert m["speedup"] == pytest.approx(m["train_samples_per_s"] / process)
    assert m["speedup_baseline"] == "1 process x 2 threads (CPU)"
    assert m["speedup_vs_one_rank"] == pytest.approx(m["train_samples_per_s"] / rank)
    assert m["speedup_vs_one_rank_baseline"] == "1 process x 1 thread (CPU)"
    assert m["scaling_efficiency"] == pytest.approx(m["speedup_vs_one_rank"] / 2)


def test_speedup_divides_by_the_best_single_process():
    from lychee_exp.core.devices import DevicePlan
    from lychee_exp.tracking.speedup import single_device_plan, single_process_plan
    from lychee_exp.tracking.throughput import speedup_facts

    cpu = DevicePlan("ddp", "cpu", 4, 2)  # 4 ranks x 2 threads
    assert (single_process_plan(cpu).num_devices, single_process_plan(cpu).threads_per_rank) == (1, 8)
    assert single_device_plan(cpu).threads_per_rank == 2
    gpu = DevicePlan("ddp", "cuda", 8, 1)
    assert single_process_plan(gpu) == single_device_plan(gpu)  # on GPUs the best single process is one GPU
    facts = speedup_facts(120.0, 60.0, 40.0, cpu)
    assert (facts["speedup"], facts["speedup_vs_one_rank"], facts["scaling_efficiency"]) == (2.0, 3.0, 0.75)
    assert facts["speedup_baseline"] == "1 process x 8 threads (CPU)"
    assert facts["speedup_vs_one_rank_baseline"] == "1 process x 2 threads (CPU)"
    missing = speedup_facts(120.0, 0.0, 0.0, cpu)  # a multi-device run without baselines has none
    assert math.isnan(missing["speedup"]) and math.isnan(missing["speedup_vs_one_rank"])
    alone = speedup_facts(50.0, 0.0, 0.0, DevicePlan("single", "cpu", 1, 2))  # a single process is its own
    assert alone["speedup"] == alone["speedup_vs_one_rank"] == 1.0


def test_bench_prints_table_csv_and_plot(tmp_path, no_wandb_key):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lychee_exp.bench.scaling",
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
            _baseline_file(tmp_path),
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


def test_the_cpu_single_process_baseline_trains_the_whole_step_in_one_process(tmp_path, tiny_cfg):
    """On CPU the best single process gets every rank's queries in one batch (the same batches as the run), the
    one-rank baseline one rank's batch; each is calibrated once, then read from the cache."""
    import dataclasses

    from lychee_exp.core.config import to_run_config
    from lychee_exp.core.devices import DevicePlan
    from lychee_exp.tracking.speedup import resolve_baselines

    cfg = to_run_config(tiny_cfg)
    speedup = dataclasses.replace(cfg.speedup, calibrate=True, baseline_file=str(tmp_path / "baselines.json"))
    cfg = dataclasses.replace(cfg, speedup=speedup)
    calls = []

    def train(calibration_cfg, plan):
        calls.append((calibration_cfg.data.batch_size, plan.num_devices, plan.threads_per_rank))
        return {"train_samples_per_s": 10.0 * plan.threads_per_rank}

    plan = DevicePlan("ddp", "cpu", 2, 1)  # 2 ranks x 1 thread, per-device batch 2
    assert resolve_baselines(cfg, plan, train) == (20.0, 10.0)
    assert calls == [(2 * cfg.data.batch_size, 1, 2), (cfg.data.batch_size, 1, 1)]
    assert resolve_baselines(cfg, plan, train) == (20.0, 10.0) and len(calls) == 2  # cached


def test_a_baseline_is_reused_only_under_the_same_step_settings(tmp_path, tiny_cfg):
    """A figure measured with another loss, chunking, bucketing or accumulation is another step's speed: dividing
    by it once gave a 9.97x 'speedup' on 2 CPU ranks. Settings that leave the step alone (lr, seed, evaluation,
    the dev file) share it, so a sweep's trials calibrate once."""
    import dataclasses

    from lychee_exp.core.config import to_run_config
    from lychee_exp.core.devices import DevicePlan
    from lychee_exp.tracking.speedup import cached_baseline, store_baseline

    cfg = to_run_config(tiny_cfg)
    cfg = dataclasses.replace(cfg, speedup=dataclasses.replace(cfg.speedup, baseline_file=str(tmp_path / "b.json")))
    plan = DevicePlan("single", "cpu", 1, 2)
    store_baseline(cfg, plan, 5.0, "test")

    def varied(section: str, **change):
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **change)})

    same = [
        varied("optimizer", lr=3e-5),
        varied("trainer", max_steps=7, evaluate=False, eval_every=3),
        varied("data", dev_file="other.jsonl", eval_batch_size=3),
        dataclasses.replace(cfg, seed=7),
        # the key holds what auto and null resolve to on this device: 4 chunks and fused AdamW on CPU
        varied("trainer", forward_chunks=4),
        varied("optimizer", fused=True),
    ]
    assert cfg.trainer.forward_chunks == "auto" and cfg.optimizer.fused is None
    assert [cached_baseline(c, plan) for c in same] == [5.0] * len(same)
    other = [
        varied("loss", name="listwise"),
        varied("trainer", forward_chunks=1),
        varied("trainer", grad_accum_steps=2),
        varied("data", bucket_by_length=True),
        varied("data", random_negatives=1),
        varied("model", dropout=0.1),
        varied("optimizer", fused=False),
    ]
    assert [cached_baseline(c, plan) for c in other] == [None] * len(other)
    assert cached_baseline(cfg, DevicePlan("single", "cpu", 1, 1)) is None  # other thread count


def _store_many(cfg, writer: int, count: int, start) -> None:
    import dataclasses

    from lychee_exp.core.devices import DevicePlan
    from lychee_exp.tracking.speedup import store_baseline

    start.wait()  # every writer starts together, so that their read-change-write cycles overlap
    for i in range(count):
        store_baseline(
            cfg,
            dataclasses.replace(DevicePlan("single", "cpu", 1, 1), threads_per_rank=1000 * writer + i),
            1.0 + i,
            f"w{writer}",
        )


def test_concurrent_baseline_writers_lose_no_entry(tmp_path, tiny_cfg):
    """Runs that end together (a sweep's concurrent trials, several sweep workers) each add their figure to the one
    cache file: every entry written must be there afterwards, not just the last writer's table."""
    import dataclasses
    import multiprocessing

    from lychee_exp.core.config import to_run_config
    from lychee_exp.core.devices import DevicePlan
    from lychee_exp.tracking.speedup import cached_baseline

    cfg = to_run_config(tiny_cfg)
    path = tmp_path / "baselines.json"
    cfg = dataclasses.replace(cfg, speedup=dataclasses.replace(cfg.speedup, baseline_file=str(path)))
    writers, count = 4, 25
    context = multiprocessing.get_context("fork")  # the writers share this process's imports
    start = context.Barrier(writers)
    procs = [context.Process(target=_store_many, args=(cfg, w, count, start)) for w in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0] * writers
    assert len(json.loads(path.read_text())) == writers * count
    plan = DevicePlan("single", "cpu", 1, 1)
    found = [
        cached_baseline(cfg, dataclasses.replace(plan, threads_per_rank=1000 * w + i))
        for w in range(writers)
        for i in range(count)
    ]
    assert found == [1.0 + i for _ in range(writers) for i in range(count)]
