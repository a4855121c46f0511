"""The DDP runner on CPU ranks (gloo): equivalence with one process, repeated and concurrent launches, and
failures that end the job quickly. Resume after SIGKILL and checkpoints: test_ddp_resume; device counts and a
global batch over 1 or 2 devices: test_ddp_devices."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest
from conftest import run_metrics, warm_ranks_kept
from ddp_helpers import TINY_DDP, run_losses, start_cli
from equivalence import assert_same_training

from lychee_exp.config.schema import to_run_config
from lychee_exp.errors import RunFailed
from lychee_exp.job.in_process import compose_job, run_job
from lychee_exp.parallel.memory_plan import plan_memory


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
    m_single, m_ddp = run_metrics(single), run_metrics(ddp)
    assert m_ddp["num_devices"] == 2 and m_ddp["effective_batch_size"] == m_single["effective_batch_size"] == 4
    assert run_losses(ddp) == pytest.approx(run_losses(single), abs=1e-5)
    # the gradient's size too: Adam's update alone would hide a gradient scaled by a constant
    assert run_losses(ddp, "train/grad_norm") == pytest.approx(run_losses(single, "train/grad_norm"), rel=1e-4)
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
    # every rank holds the whole state, as `python -m lychee_exp.plan` says before the run
    plan = plan_memory(to_run_config(compose_job(QUICK_DDP, run_dir)), 2, "fp32", checkpointing=False)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert plan.per_rank(key) == m[f"{key}_per_rank"] and len(set(m[f"{key}_per_rank"])) == 1, key


def test_five_runs_in_one_process(five_quick_runs):
    """Five launches from one process (fresh ranks each time) give five equal, finite results."""
    runs = five_quick_runs
    values, outcomes = [value for _, value, _ in runs], [_outcome(metrics) for _, _, metrics in runs]
    assert all(math.isfinite(v) for v in values) and all(math.isfinite(v) for v in outcomes[0][:3]), outcomes[0]
    assert values == [values[0]] * 5 and outcomes == [outcomes[0]] * 5, outcomes
    assert values[0] == runs[0][2]["model_ndcg@10"] and outcomes[0][3] == 2  # the optimized metric: the model's own


def test_two_runs_at_the_same_moment(tmp_path, five_quick_runs):
    """Two jobs started together on one machine (each picks its own rendezvous port) each finish with the
    metrics that the same job gets running alone."""
    alone = five_quick_runs[0][2]
    procs = [start_cli(QUICK_DDP, tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    run_dirs = sorted((tmp_path / "outputs" / "runs").iterdir())
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert _outcome(run_metrics(run_dir)) == pytest.approx(_outcome(alone), abs=1e-6), run_dir.name


def test_failing_rank_ends_the_job_quickly(tmp_path):
    """Through the CLI: its exit 1 and one line for a failed run (a killed rank's line: the next test)."""
    proc = start_cli(
        [*TINY_DDP, "parallel=ddp", "gpus=2", f"hydra.run.dir={tmp_path}"],
        tmp_path,
        env={"LYCHEE_FAULT": "1:2:raise"},
    )
    out, err = proc.communicate(timeout=180)
    ended = time.time()
    assert proc.returncode == 1
    # the acceptance bound: the job ends within 30 s of the fault (timed from the rank's own log line)
    assert ended - _fired_at(tmp_path, 1) < TEARDOWN_BOUND_S
    errors = [line for line in (out + err).splitlines() if "error:" in line]
    assert len(errors) == 1 and "rank 1 failed" in errors[0] and "stderr.log" in errors[0], errors
    assert "injected fault" in errors[0]
    assert "Traceback" not in out + err
    assert not (tmp_path / "metrics.json").exists()


def test_killed_rank_ends_the_job_quickly(tmp_path):
    """In-process (the CLI prints a failed run's one line as above): a rank killed by SIGKILL ends the job
    within the bound, and the job's one line names it."""
    with pytest.MonkeyPatch.context() as patch, pytest.raises(RunFailed) as info:
        patch.setenv("LYCHEE_FAULT", "1:2:kill")
        run_job([*TINY_DDP, "parallel=ddp", "gpus=2"], tmp_path)
    assert time.time() - _fired_at(tmp_path, 1) < TEARDOWN_BOUND_S
    line = str(info.value)
    assert "\n" not in line and "stderr.log" in line, line
    # the signal by name, the likely cause, and the peak memory the launcher saw of the rank (a SIGKILLed rank
    # cannot report its own): a rank with torch and the model loaded holds well over 100 MB
    said = re.search(
        r"^rank 1 was killed by SIGKILL \(signal 9\), most likely by the kernel's out-of-memory killer: it peaked at "
        r"(\d+\.\d\d) GB resident \(the machine has \d+ GB, \d+\.\d GB free now\)",
        line,
    )
    assert said and 0.1 < float(said[1]) < 64, line
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
