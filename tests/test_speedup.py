"""Observed speedup (lychee_exp.tracking.speedup, lychee_exp.train.baseline_phase): one ratio over one device,
its reliability rules, the baseline cache, and the launch's first phase that measures one device inside the
ranks without changing the run."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_RANKS, run_metrics, warm_ranks_kept
from equivalence import assert_same_training

from lychee_exp.config.schema import to_run_config
from lychee_exp.job.in_process import run_job
from lychee_exp.parallel.devices import DevicePlan
from lychee_exp.tracking.speedup import (
    Baseline,
    baseline_file,
    cached_baseline,
    cpu_share,
    speedup_facts,
    speedup_note,
    store_baseline,
)
from lychee_exp.tracking.wandb_records import find_run_files, read_run

CPU_RANKS = DevicePlan("ddp", "cpu", 2, 1)  # 2 ranks x 1 thread
# dropout on: the phase's steps draw random numbers, which the run must not notice; 32 train queries: 4 micro-batches
# of 4 on each of 2 ranks, so that grad_accum_steps=4 accumulates 4 of them in every step
PHASED = [
    *(o for o in TINY_RANKS if not o.startswith("data.max_train_queries=")),
    "data.max_train_queries=32",
    "parallel=ddp",
    "gpus=2",
    "parallel.cpu_threads_per_rank=1",
    "model.dropout=0.1",
]
ACCUMULATED = [*PHASED, "trainer.grad_accum_steps=4"]


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "baselines.json"
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(path))
    return path


def test_speedup_is_one_ratio_over_one_device(monkeypatch):
    facts = speedup_facts(30.0, Baseline(20.0, "test", cpu_share=0.95), 2, CPU_RANKS)
    assert (facts["speedup"], facts["scaling_efficiency"], facts["speedup_status"]) == (1.5, 0.75, "measured")
    assert facts["speedup_baseline"] == "1 device (1 rank x 1 thread, CPU)"
    assert speedup_note(facts) == "; speedup 1.50x over 1 device (1 rank x 1 thread, CPU)"
    assert not any(key.startswith("speedup_vs") for key in facts)  # one figure, not two
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index=0: "H200")
    gpu = speedup_facts(70.0, Baseline(10.0, "test"), 8, DevicePlan("ddp", "cuda", 8, 1))  # no CPU rule on GPUs
    assert (gpu["speedup"], gpu["speedup_baseline"]) == (7.0, "1 device (1 GPU, H200)")


def test_unreliable_figures_are_reported_not_divided():
    shared = speedup_facts(30.0, Baseline(20.0, "test", cpu_share=0.41), 2, CPU_RANKS)
    assert "speedup" not in shared and "scaling_efficiency" not in shared
    assert shared["speedup_status"] == "unreliable: machine shared (baseline at 41% CPU)"
    assert speedup_note(shared) == "; no speedup (unreliable: machine shared (baseline at 41% CPU))"
    # the figure once recorded for 2 ranks on 2 cores: above the device count, so a timing was disturbed
    impossible = speedup_facts(89.0, Baseline(20.0, "test", cpu_share=1.0), 2, CPU_RANKS)
    assert "speedup" not in impossible
    assert impossible["speedup_status"].startswith("unreliable: impossible ratio (4.45x on 2 device(s))")
    assert speedup_facts(40.0, Baseline(20.0, "test", cpu_share=1.0), 2, CPU_RANKS)["speedup"] == 2.0  # the bound
    assert "speedup" not in speedup_facts(40.2, Baseline(20.0, "test", cpu_share=1.0), 2, CPU_RANKS)  # never above it
    unmeasured = speedup_facts(30.0, None, 2, CPU_RANKS)
    assert "speedup" not in unmeasured and unmeasured["speedup_status"].startswith("unmeasured")
    assert cpu_share(1.5, 1.0, 2) == 0.75 and cpu_share(1.0, 0.0, 1) is None


def test_only_reliable_baselines_are_cached(own_cache, tiny_cfg):
    cfg, one = to_run_config(tiny_cfg), DevicePlan("single", "cpu", 1, 1)
    assert baseline_file() == own_cache
    assert not store_baseline(cfg, one, Baseline(20.0, "busy", cpu_share=0.5)) and not own_cache.exists()
    assert store_baseline(cfg, one, Baseline(20.0, "quiet", cpu_share=0.9))
    found = cached_baseline(cfg, one)
    assert (found.samples_per_s, found.source, found.cpu_share) == (20.0, "quiet", 0.9) and found.measured_at
    # a figure judged unreliable in the file (written by hand, or by an older rule) is never divided by
    table = json.loads(own_cache.read_text())
    (key,) = table
    own_cache.write_text(json.dumps({key: {**table[key], "cpu_share": 0.3}}))
    assert cached_baseline(cfg, one) is None


def test_a_baseline_is_reused_only_under_the_same_step_settings(own_cache, tiny_cfg):
    """A figure measured with another loss, chunking or bucketing is another step's speed: dividing by it once gave
    a 9.97x 'speedup' on 2 CPU ranks. Settings that leave one device's samples/s alone (lr, seed, evaluation, the
    dev file, the accumulation that a sweep over the global batch varies) share it, so a sweep's trials measure
    once."""
    cfg = to_run_config(tiny_cfg)
    plan = DevicePlan("single", "cpu", 1, 2)
    store_baseline(cfg, plan, Baseline(5.0, "test", cpu_share=1.0))

    def varied(section: str, **change):
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **change)})

    def figure(c, p=plan):
        found = cached_baseline(c, p)
        return found and found.samples_per_s

    same = [
        varied("optimizer", lr=3e-5),
        varied("trainer", max_steps=7, evaluate=False, eval_every=3),
        varied("data", dev_file="other.jsonl", eval_batch_size=3),
        dataclasses.replace(cfg, seed=7),
        # the key holds what auto and null resolve to on this device: 4 chunks and fused AdamW on CPU
        varied("trainer", forward_chunks=4),
        varied("optimizer", fused=True),
        varied("trainer", grad_accum_steps=2, global_batch_size=16),
    ]
    assert cfg.trainer.forward_chunks == "auto" and cfg.optimizer.fused is None
    assert [figure(c) for c in same] == [5.0] * len(same)
    other = [
        varied("loss", name="listwise"),
        varied("trainer", forward_chunks=1),
        varied("data", bucket_by_length=True),
        varied("data", random_negatives=1),
        varied("model", dropout=0.1),
        varied("optimizer", fused=False),
    ]
    assert [figure(c) for c in other] == [None] * len(other)
    assert figure(cfg, DevicePlan("single", "cpu", 1, 1)) is None  # other thread count


def _store_many(cfg, writer: int, count: int, start) -> None:
    start.wait()  # every writer starts together, so that their read-change-write cycles overlap
    for i in range(count):
        plan = DevicePlan("single", "cpu", 1, 1000 * writer + i)
        store_baseline(cfg, plan, Baseline(1.0 + i, f"w{writer}", cpu_share=1.0))


def test_concurrent_baseline_writers_lose_no_entry(own_cache, tiny_cfg):
    """Runs that end together (a sweep's concurrent trials, several sweep workers) each add their figure to the one
    cache file: every entry written must be there afterwards, not just the last writer's table."""
    cfg = to_run_config(tiny_cfg)
    writers, count = 4, 25
    context = multiprocessing.get_context("fork")  # the writers share this process's imports and environment
    start = context.Barrier(writers)
    procs = [context.Process(target=_store_many, args=(cfg, w, count, start)) for w in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0] * writers
    assert len(json.loads(own_cache.read_text())) == writers * count
    found = [
        cached_baseline(cfg, DevicePlan("single", "cpu", 1, 1000 * w + i)).samples_per_s
        for w in range(writers)
        for i in range(count)
    ]
    assert found == [1.0 + i for _ in range(writers) for i in range(count)]


@pytest.fixture(scope="module")
def phased_runs(tmp_path_factory) -> Path:
    """gpus=2 on one start of ranks (the phase and its figure are measured inside the ranks either way): without
    the phase, with it (nothing cached: rank 0 times one device first), the same with 4 micro-batches a step (the
    cache of the run before), then with busy loops on every core. Each but the accumulating run has its own
    baseline cache (LYCHEE_* goes to the ranks with each job, not at their start)."""
    root = tmp_path_factory.mktemp("phased")
    with pytest.MonkeyPatch.context() as patch, warm_ranks_kept():
        for key in ("WANDB_API_KEY", "WANDB_MODE"):  # no W&B API key: the loaded run's record goes offline
            patch.delenv(key, raising=False)
        patch.setenv("HOME", str(root / "home"))
        patch.setenv("WANDB_CONFIG_DIR", str(root / "wandb-config"))
        patch.setenv("LYCHEE_BASELINE_FILE", str(root / "without.json"))
        run_job([*PHASED, "trainer.measure_speedup=false"], root / "without")
        patch.setenv("LYCHEE_BASELINE_FILE", str(root / "with.json"))
        run_job(PHASED, root / "with")
        run_job(ACCUMULATED, root / "accumulated")
        patch.setenv("LYCHEE_BASELINE_FILE", str(root / "loaded.json"))
        cores = os.cpu_count() or 2
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores + 1)]
        try:  # evaluation shows nothing here: off
            run_job([*PHASED, "logger=wandb", "trainer.evaluate=false"], root / "loaded")
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
    return root


@pytest.mark.slow
def test_the_baseline_phase_leaves_the_run_unchanged_and_caches_its_figure(phased_runs):
    """gpus=2 with the phase trains the same losses, gradient norms and final weights as with it off; its figure,
    when the machine was quiet enough, is cached under one device's key (one rank's batch and threads), which
    later runs read (test_cluster's SLURM test)."""
    with_phase, without = phased_runs / "with", phased_runs / "without"
    assert not (phased_runs / "without.json").exists() and "baseline_samples_per_s" not in run_metrics(without)
    assert_same_training(with_phase, without, rtol=1e-6)
    m = run_metrics(with_phase)
    assert m["baseline_samples_per_s"] > 0 and m["baseline_cpu_share"] > 0
    assert m.get("speedup", 0.0) <= 2 and ("speedup" in m) == (m["speedup_status"] == "measured")
    own_cache = phased_runs / "with.json"
    cached = json.loads(own_cache.read_text()) if own_cache.exists() else {}
    if m["baseline_cpu_share"] < 0.75:  # a busy machine: reported, not cached
        assert cached == {} and m["speedup_status"].startswith("unreliable: machine shared")
        return
    ((key, entry),) = cached.items()
    assert key.endswith("|cpu x1 threads") and "|batch4|" in key and entry["source"].startswith("launch phase of ")
    assert entry["samples_per_s"] == m["baseline_samples_per_s"]


@pytest.mark.slow
def test_a_run_on_a_loaded_machine_records_why_it_has_no_speedup(phased_runs):
    """Busy loops on every core while gpus=2 trains: the one-device figure is measured with a fraction of a
    core, so the run records no speedup (never one above its 2 devices) but the reason, in metrics.json and
    W&B, and caches nothing."""
    m = run_metrics(phased_runs / "loaded")
    assert "speedup" not in m and "scaling_efficiency" not in m
    assert m["baseline_cpu_share"] < 0.75
    assert m["speedup_status"].startswith("unreliable: machine shared (baseline at ")
    (record,) = [read_run(path) for path in find_run_files(phased_runs / "loaded")]
    assert "speedup" not in record["summary"] and record["summary"]["speedup_status"] == m["speedup_status"]
    assert not (phased_runs / "loaded.json").exists()


@pytest.mark.slow
def test_runs_differing_only_in_accumulation_share_one_baseline(phased_runs):
    """A sweep over the global batch varies grad_accum_steps from trial to trial: the one-device figure the first
    run measured serves the run with 4 micro-batches a step, not measured again (that cost each new accumulation
    1-2 s of trial overhead), and both ratios are samples/s over samples/s, so the speedup does not move by the
    accumulation factor (a rate per optimizer step would divide it by 4)."""
    first, accumulated = run_metrics(phased_runs / "with"), run_metrics(phased_runs / "accumulated")
    assert (first["grad_accum_steps"], accumulated["grad_accum_steps"]) == (1, 4)
    if first["baseline_cpu_share"] < 0.75:  # a busy machine: the first figure was not cached, nothing to share
        pytest.skip("the first run's baseline was timed on a shared machine and not cached")
    (entry,) = json.loads((phased_runs / "with.json").read_text()).values()
    assert entry["source"] == f"launch phase of {phased_runs / 'with'}"  # the accumulating run timed none
    assert accumulated["baseline_samples_per_s"] == first["baseline_samples_per_s"] == entry["samples_per_s"]
    if {first["speedup_status"], accumulated["speedup_status"]} != {"measured"}:
        pytest.skip(f"no speedup to compare: {first['speedup_status']}, {accumulated['speedup_status']}")
    assert accumulated["speedup"] == pytest.approx(accumulated["train_samples_per_s"] / entry["samples_per_s"])
    assert 1 / 2.5 < accumulated["speedup"] / first["speedup"] < 2.5
