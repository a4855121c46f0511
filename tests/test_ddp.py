"""The DDP runner on CPU ranks (gloo): equivalence with one process, repeated and concurrent launches,
failures that end the job quickly, and resume after SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_RANKS, warm_ranks_kept
from safetensors.torch import load_file

from lychee_exp.core.devices import plan_devices
from lychee_exp.core.errors import RunFailed, UserError
from lychee_exp.testing.equivalence import assert_same_training
from lychee_exp.testing.jobs import run_job

# Tiny Lychee path, fp32, no dropout: one process with batch 2b and 2 ranks with batch b must agree.
TINY_DDP = [
    *TINY_RANKS,
    "optimizer.lr=1e-3",
    # no speedup baseline phase: these runs compare training, not throughput
    "trainer.measure_speedup=false",
]


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _losses(run_dir: Path, key: str = "train/loss") -> list[float]:
    import csv

    with (run_dir / "metrics.csv").open() as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def _cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """single_process_run(bucket) -> the run dir of one process with batch 4: the reference that every DDP variant
    of that bucketing must match, trained once per module (the runs are seeded, so each variant would get the same)."""
    runs: dict[bool, Path] = {}

    def run(bucket: bool) -> Path:
        if bucket not in runs:
            runs[bucket] = tmp_path_factory.mktemp(f"single-bucket-{bucket}")
            bucketing = [f"data.bucket_by_length={bucket}", "data.bucket_pool_batches=2"]
            run_job([*TINY_DDP, *bucketing, "parallel=single", "data.batch_size=4"], runs[bucket])
        return runs[bucket]

    return run


# ddp_batch, accum, bucket, chunks, packing. chunks: the DDP run forwards its pairs in length chunks, the single
# process in one pass; packing: the DDP run packs each micro-batch into one row, the single process pads.
DDP_VARIANTS = {
    "batch": (2, 1, False, 1, False),
    "accumulation": (1, 2, False, 1, False),
    "accumulation-bucketed-chunked": (1, 2, True, 2, False),
    "accumulation-bucketed-packed": (1, 2, True, 1, True),
}


@pytest.fixture(scope="module")
def ddp_variant_runs(tmp_path_factory) -> dict[str, Path]:
    """Every DDP variant's run dir, trained once per module on the same warm ranks (their setup is the same)."""
    runs = {name: tmp_path_factory.mktemp(f"ddp-{name}") for name in DDP_VARIANTS}
    with warm_ranks_kept():
        for name, (ddp_batch, accum, bucket, chunks, packing) in DDP_VARIANTS.items():
            settings = [f"data.batch_size={ddp_batch}", f"trainer.grad_accum_steps={accum}"]
            settings += [f"trainer.forward_chunks={chunks}", f"data.packing={packing}", "data.bucket_pool_batches=2"]
            run_job([*TINY_DDP, "parallel=ddp", "gpus=2", f"data.bucket_by_length={bucket}", *settings], runs[name])
    return runs


@pytest.mark.parametrize("variant", list(DDP_VARIANTS))
def test_ddp_matches_single_process(single_process_run, ddp_variant_runs, variant):
    single, ddp = single_process_run(DDP_VARIANTS[variant][2]), ddp_variant_runs[variant]
    m_single, m_ddp = _metrics(single), _metrics(ddp)
    assert m_ddp["num_devices"] == 2 and m_ddp["effective_batch_size"] == m_single["effective_batch_size"] == 4
    assert _losses(ddp) == pytest.approx(_losses(single), abs=1e-5)
    # the gradient's size too: Adam's update alone would hide a gradient scaled by a constant
    assert _losses(ddp, "train/grad_norm") == pytest.approx(_losses(single, "train/grad_norm"), rel=1e-4)
    # sharded, gathered dev evaluation equals the single-process one (same initial weights)
    assert m_ddp["initial_ndcg@10"] == pytest.approx(m_single["initial_ndcg@10"], abs=1e-6)
    assert m_ddp["initial_mrr@10"] == pytest.approx(m_single["initial_mrr@10"], abs=1e-6)
    # the pre-clip gradient norm of every step and the final weights: a gradient off by a constant factor on the
    # DDP ranks (which AdamW would divide out of the losses) fails here
    assert_same_training(ddp, single)


def _outcome(metrics: dict) -> tuple:
    """What a seeded run must reproduce exactly, wherever and however often it runs."""
    return tuple(metrics[key] for key in ("train_loss", "ndcg@10", "mrr@10", "steps", "effective_batch_size"))


# Short DDP runs, without the evaluation before training (no test below reads initial_*); 2 ranks x batch 2 x
# accumulation 2, the setup that test_metrics_record_the_parallel_setup reads back.
QUICK_DDP = [
    *TINY_DDP,
    "parallel=ddp",
    "gpus=2",
    "data.batch_size=2",
    "trainer.grad_accum_steps=2",
    "trainer.max_steps=2",
    "trainer.save_model=false",
    "trainer.eval_before_training=false",
]


@pytest.fixture(scope="module")
def five_quick_runs(tmp_path_factory) -> list[tuple[Path, float, dict]]:
    """QUICK_DDP launched five times from this process (fresh ranks each time): each run's dir, what it returned
    and its metrics. The first one is also the "alone" reference of two runs at the same moment."""
    root = tmp_path_factory.mktemp("quick")
    return [(root / f"run{i}", *run_job(QUICK_DDP, root / f"run{i}")) for i in range(5)]


def test_metrics_record_the_parallel_setup(five_quick_runs):
    run_dir, _, m = five_quick_runs[0]
    assert (m["num_devices"], m["per_device_batch_size"], m["grad_accum_steps"]) == (2, 2, 2)
    assert m["effective_batch_size"] == 8 and m["device"] == "cpu"
    assert m["lr"] == pytest.approx(1e-3)  # lr_scaling=none
    assert m["train_samples_per_s"] > 0 and 0 <= m["data_wait_share"] < 1 and m["rank_time_spread"] >= 1
    assert len(m["peak_memory_mb_per_rank"]) == 2 and min(m["peak_memory_mb_per_rank"]) > 0
    assert (run_dir / "logs").is_dir() and list((run_dir / "logs").glob("**/1/stderr.log"))


def test_five_runs_in_one_process(five_quick_runs):
    """Five launches from one process (fresh ranks each time) give five equal, finite results."""
    runs = five_quick_runs
    values, outcomes = [value for _, value, _ in runs], [_outcome(metrics) for _, _, metrics in runs]
    assert all(math.isfinite(v) for v in values) and all(math.isfinite(v) for v in outcomes[0][:3]), outcomes[0]
    assert values == [values[0]] * 5 and outcomes == [outcomes[0]] * 5, outcomes
    assert values[0] == runs[0][2]["ndcg@10"] and outcomes[0][3] == 2


def test_two_runs_at_the_same_moment(tmp_path, five_quick_runs):
    """Two jobs started together on one machine (each picks its own rendezvous port) each finish with the
    metrics that the same job gets running alone."""
    alone = five_quick_runs[0][2]
    procs = [_cli(QUICK_DDP, tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    run_dirs = sorted((tmp_path / "outputs" / "runs").iterdir())
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert _outcome(_metrics(run_dir)) == pytest.approx(_outcome(alone), abs=1e-6), run_dir.name


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_failing_rank_ends_the_job_quickly(tmp_path, action):
    proc = _cli(
        [*TINY_DDP, "parallel=ddp", "gpus=2", f"hydra.run.dir={tmp_path}"],
        tmp_path,
        env={"LYCHEE_FAULT": f"1:2:{action}"},
    )
    out, err = proc.communicate(timeout=180)
    ended = time.time()
    assert proc.returncode == 1
    # the acceptance bound: the job ends within 30 s of the fault (timed from the rank's own log line)
    assert ended - _fired_at(tmp_path, 1) < TEARDOWN_BOUND_S
    errors = [line for line in (out + err).splitlines() if "error:" in line]
    assert len(errors) == 1 and "rank 1 failed" in errors[0] and "stderr.log" in errors[0], errors
    assert ("injected fault" if action == "raise" else "SIGKILL") in errors[0]
    assert "Traceback" not in out + err
    assert not (tmp_path / "metrics.json").exists()


def _fired_at(run_dir: Path, rank: int) -> float:
    """When LYCHEE_FAULT fired on that rank, from the line it printed into the rank's log."""
    fired = [
        line
        for log in run_dir.glob(f"logs/**/{rank}/stderr.log")
        for line in log.read_text().splitlines()
        if line.startswith("LYCHEE_FAULT")
    ]
    assert len(fired) == 1, fired
    return float(fired[0].split()[-1])


# How long after the collective timeout the job may take to notice, stop the other ranks and exit: the
# acceptance bound of a failing rank (30 s), which covers the agent's teardown on this loaded 2-core machine.
TEARDOWN_BOUND_S = 30


def test_hanging_rank_is_bounded_by_the_collective_timeout(tmp_path):
    """In-process: the CLI's exit 1 and one line for a failed run are tested above (a failing rank)."""
    timeout_s = 5
    args = [*TINY_DDP, "parallel=ddp", "gpus=2", f"parallel.timeout_s={timeout_s}"]
    with pytest.MonkeyPatch.context() as patch, pytest.raises(RunFailed) as info:
        patch.setenv("LYCHEE_FAULT", "1:2:hang")  # rank 1 sleeps an hour after step 2
        run_job(args, tmp_path)
    took = time.time() - _fired_at(tmp_path, 1)
    assert not (tmp_path / "metrics.json").exists()
    # the collective timeout is what ended it: not before timeout_s, and within timeout_s + the teardown bound
    assert timeout_s <= took < timeout_s + TEARDOWN_BOUND_S, took
    assert str(info.value).startswith("rank 0 failed") and "\n" not in str(info.value), str(info.value)


def test_nan_loss_stops_the_job(tmp_path):
    """In-process: the CLI's exit 1 and one line for a failed run are tested above (a failing rank)."""
    overrides = [*TINY_DDP, "parallel=single", "optimizer.lr=1e30", "optimizer.max_grad_norm=0", "trainer.max_steps=20"]
    with pytest.raises(RunFailed, match=r"loss is (nan|inf)"):
        run_job(overrides, tmp_path)
    assert not (tmp_path / "metrics.json").exists()


def _resume_args(bucket: bool) -> list[str]:
    return [
        *TINY_DDP,
        "parallel=ddp",
        "gpus=2",
        "data.batch_size=2",
        "trainer.max_steps=8",
        "trainer.checkpoint_every=2",
        "trainer.eval_every=4",
        f"data.bucket_by_length={bucket}",
    ]


@pytest.fixture(scope="module")
def uninterrupted_runs(tmp_path_factory) -> dict[bool, Path]:
    """bucket -> the uninterrupted run that a resumed one must match; both trained on one set of warm ranks."""
    runs = {bucket: tmp_path_factory.mktemp(f"uninterrupted-bucket-{bucket}") for bucket in (False, True)}
    with warm_ranks_kept():
        for bucket, run_dir in runs.items():
            run_job(_resume_args(bucket), run_dir)
    return runs


@pytest.mark.parametrize("bucket", [False, True], ids=["plain", "bucketed"])
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, uninterrupted_runs, bucket):
    args, reference, killed = _resume_args(bucket), uninterrupted_runs[bucket], tmp_path / "killed"
    proc = _cli([*args, f"hydra.run.dir={killed}"], tmp_path, env={"LYCHEE_FAULT": "0:5:hang"})
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "step_000004").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGKILL)  # the launcher alone: its ranks must die with it (PDEATHSIG)
    proc.communicate(timeout=30)
    # the resume in this process, on fresh ranks (the CLI around a run is tested by the killed run above)
    run_job([*args, "trainer.resume=auto"], killed)
    rank0_logs = [p.read_text() for p in killed.glob("logs/**/0/stderr.log")]
    assert sum("resumed from" in text for text in rank0_logs) == 1, rank0_logs
    m_ref, m_res = _metrics(reference), _metrics(killed)
    for key in ("ndcg@10", "mrr@10", "initial_ndcg@10", "train_loss"):
        assert m_res[key] == pytest.approx(m_ref[key], abs=1e-5), key
    assert m_res["steps"] == 8
    assert 0 < m_res["padding_share"] < 1
    assert_same_training(killed, reference)  # every step's loss and pre-clip gradient norm, and the weights


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    run_job(
        [
            *TINY_DDP,
            "parallel=single",
            "trainer.max_steps=6",
            "trainer.checkpoint_every=2",
            "trainer.keep_checkpoints=2",
        ],
        tmp_path,
    )
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000004", "step_000006"]
    assert (root / "latest").read_text().strip() == "step_000006"
    assert not list(root.glob(".tmp*"))
    state = torch.load(root / "step_000006" / "state.pt", weights_only=True)
    assert state["step"] == 6


def test_gpu_count_checks():
    with pytest.raises(UserError, match=r"gpus=4 but only 2 CUDA GPU"):
        plan_devices("ddp", 4, cuda_count=2, cores=16)
    with pytest.raises(UserError, match=r"parallel=dp needs CUDA GPUs"):
        plan_devices("dp", "auto", cuda_count=0, cores=2)
    assert plan_devices("ddp", "auto", cuda_count=4, cores=16).num_devices == 4
    cpu = plan_devices("ddp", 3, cuda_count=0, cores=6)
    assert (cpu.device_type, cpu.num_devices, cpu.threads_per_rank) == ("cpu", 3, 2)
    assert plan_devices("ddp", "auto", cuda_count=0, cores=2).num_devices == 2
    # one process: every core unless parallel.cpu_threads_per_rank says otherwise (the 1 x 1 thread baseline)
    assert plan_devices("single", 1, cuda_count=0, cores=2).threads_per_rank == 2
    assert plan_devices("single", 1, cuda_count=0, cores=2, cpu_threads_per_rank=1).threads_per_rank == 1


def test_dp_without_cuda_is_one_line(tmp_path):
    """The job stops with a user error before any training (the CLI's exit 2 and one line for a user error are
    tested once, in tests/test_data.py and tests/test_config.py: here in-process, without a subprocess)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="parallel=dp needs CUDA GPUs") as info:
        run_job(["parallel=dp"], tmp_path)
    assert "\n" not in str(info.value) and not (tmp_path / "metrics.json").exists()


def _global_batch_run(tmp_path: Path, name: str, gpus: int, *extra: str) -> Path:
    run_dir = tmp_path / name
    run_job(
        [*TINY_DDP, "parallel=ddp", f"gpus={gpus}", "data.batch_size=2", "trainer.global_batch_size=4", *extra], run_dir
    )
    return run_dir


def test_a_global_batch_trains_the_same_steps_on_one_device_and_on_two(tmp_path):
    """A sweep trial may land on a 1-device or a 2-device slot: trainer.global_batch_size makes the 1-device run
    accumulate 2 micro-batches, and both train the same steps: losses (1e-5 relative) and every parameter's
    gradient."""
    sgd = ["optimizer.name=sgd", "optimizer.weight_decay=0", "optimizer.max_grad_norm=0", "optimizer.warmup_ratio=0"]
    sgd += ["optimizer.scheduler=constant", "trainer.max_steps=1"]
    with warm_ranks_kept():  # the 1-device runs first, then the 2-device ones: one start of ranks for each setup
        one, w0, g1 = (
            _global_batch_run(tmp_path, "one", 1),
            _global_batch_run(tmp_path, "w0", 1, *sgd, "optimizer.lr=1e-30"),
            _global_batch_run(tmp_path, "g1", 1, *sgd, "optimizer.lr=1"),
        )
        two, g2 = _global_batch_run(tmp_path, "two", 2), _global_batch_run(tmp_path, "g2", 2, *sgd, "optimizer.lr=1")
    m_one, m_two = _metrics(one), _metrics(two)
    assert (m_one["num_devices"], m_one["grad_accum_steps"]) == (1, 2)
    assert (m_two["num_devices"], m_two["grad_accum_steps"]) == (2, 1)
    assert m_one["effective_batch_size"] == m_two["effective_batch_size"] == 4
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)
    assert_same_training(two, one, rtol=1e-5)
    # per-parameter gradients of the first step: plain SGD at lr 1 without clipping makes w1 = w0 - g, and w0 is
    # a run whose lr is too small to move any weight
    w0 = _weights(w0)
    g_one = {k: w0[k] - w for k, w in _weights(g1).items()}
    g_two = {k: w0[k] - w for k, w in _weights(g2).items()}
    assert g_one.keys() == g_two.keys() == w0.keys()
    assert sum(bool(g.abs().max() > 0) for g in g_one.values()) > len(g_one) // 2  # the step moved the weights
    for key in g_one:
        torch.testing.assert_close(g_two[key], g_one[key], rtol=1e-4, atol=1e-6, msg=key)


def test_a_global_batch_that_does_not_divide_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"trainer.global_batch_size=6 is not a multiple of data.batch_size=2 x 2"):
        run_job([*TINY_DDP, "parallel=ddp", "gpus=2", "data.batch_size=2", "trainer.global_batch_size=6"], tmp_path)


def test_a_global_batch_with_a_token_budget_is_one_line(tmp_path):
    """A token budget's steps hold a varying number of queries, so a fixed global batch cannot be reached: the
    line names the key that can (trainer.global_tokens_per_step); which needs a budget, and must divide."""
    budget = ["parallel=ddp", "gpus=2", "data.max_tokens_per_batch=4096"]
    with pytest.raises(UserError, match=r"global_batch_size=4 counts queries .*max_tokens_per_batch=4096.*tokens_per"):
        run_job([*TINY_DDP, *budget, "trainer.global_batch_size=4"], tmp_path)
    with pytest.raises(UserError, match=r"^trainer.global_tokens_per_step=8192 needs a token budget"):
        run_job([*TINY_DDP, "parallel=ddp", "gpus=2", "trainer.global_tokens_per_step=8192"], tmp_path)
    with pytest.raises(UserError, match=r"global_tokens_per_step=12288 is not a multiple of .*=4096 x 2 device"):
        run_job([*TINY_DDP, *budget, "trainer.global_tokens_per_step=12288"], tmp_path)
    with pytest.raises(UserError, match=r"global_batch_size=4 and trainer.global_tokens_per_step=8192 both"):
        run_job([*TINY_DDP, *budget, "trainer.global_batch_size=4", "trainer.global_tokens_per_step=8192"], tmp_path)
