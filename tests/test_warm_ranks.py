"""Warm ranks: DDP ranks that a sweep worker keeps from one trial to the next.

The pool itself (lychee_exp.launch.warm_ranks) on small jobs: the same processes serve several jobs; a job that fails,
dies or hangs on one rank ends every rank, with each rank's reason, and the next job gets new ones. Then real
sweeps of the tiny model on 2 CPU ranks: warm trials equal fresh-process trials, and a failed trial (raise,
OOM, SIGKILL) is followed by a trial on new ranks.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from conftest import TINY_RANKS, run_metrics
from equivalence import assert_same_training
from hydra_in_process import run_in_process
from optuna.trial import TrialState
from warm_rank_jobs import form_group, never_forms, stuck_forming, summed

from lychee_exp.config.schema import to_run_config
from lychee_exp.io.user_files import resolve_path
from lychee_exp.launch.warm_ranks import RankSetup, RanksFailed, WarmRanks, close_warm_ranks, warm_ranks
from lychee_exp.train.inputs import load_inputs

SETUP = RankSetup(world_size=2, device_type="cpu", threads=1, backend="gloo", timeout_s=20)


@pytest.fixture
def pool():
    ranks = WarmRanks(SETUP, form_group, summed)
    yield ranks
    ranks.close(kill=True)


def test_the_same_processes_serve_every_job(pool):
    pool.start()
    first = pool.run(1.5)
    second = pool.run(2.0)
    assert [r["sum"] for r in first] == [3.0, 3.0] and [r["sum"] for r in second] == [4.0, 4.0]
    assert [r["rank"] for r in first] == [0, 1]
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == [p.pid for p in pool.processes]
    pool.close()
    assert pool.processes == [] and not pool.alive


@pytest.mark.parametrize(
    "fault, expected",
    [("raise", "ValueError: bad value on rank 1"), ("kill", "killed by SIGKILL (signal 9), most likely by the kernel")],
)
def test_a_failing_rank_ends_every_rank(pool, fault, expected):
    pool.start()
    processes = list(pool.processes)
    started = time.monotonic()
    with pytest.raises(RanksFailed) as failed:
        pool.run(1.0, fault)
    assert time.monotonic() - started < 15
    assert failed.value.failures[1][1].startswith(expected)
    assert not any(p.is_alive() for p in processes) and not pool.alive


def test_a_hanging_rank_is_ended_after_its_peer_times_out(pool):
    """Rank 1 sleeps; rank 0 waits in the all-reduce until the collective timeout, fails, and both end."""
    pool.setup = RankSetup(2, "cpu", 1, "gloo", timeout_s=3)
    pool.start()
    started = time.monotonic()
    with pytest.raises(RanksFailed) as failed:
        pool.run(1.0, "hang")
    assert 3 <= time.monotonic() - started < 20
    assert set(failed.value.failures) == {0}  # rank 1 said nothing: it was killed after rank 0's failure
    assert not pool.alive


def test_ranks_that_cannot_form_their_group_fail_at_start():
    ranks = WarmRanks(SETUP, never_forms, summed)
    with pytest.raises(RanksFailed, match="no network here"):
        ranks.start()
    ranks.close(kill=True)


def test_ranks_stuck_forming_their_group_fail_at_the_start_deadline(monkeypatch):
    import lychee_exp.launch.warm_ranks as warm

    monkeypatch.setattr(warm, "START_TIMEOUT_S", 3.0)
    ranks = WarmRanks(SETUP, stuck_forming, summed)
    started = time.monotonic()
    with pytest.raises(RanksFailed) as failed:
        ranks.start()
    assert 3 <= time.monotonic() - started < 30  # not the 1 h sleep, nor the collective timeout
    assert {why for _, why in failed.value.failures.values()} == {"not ready after 3 s"}
    assert set(failed.value.failures) == {0, 1}
    assert not ranks.alive


def test_the_process_keeps_ranks_while_they_fit_and_renews_them_after_a_failure():
    try:
        ranks, reused = warm_ranks(SETUP, form_group, summed)
        pids = [r["pid"] for r in ranks.run(1.0)]
        again, reused_again = warm_ranks(SETUP, form_group, summed)
        assert (reused, reused_again) == (False, True) and again is ranks
        with pytest.raises(RanksFailed):
            again.run(1.0, "raise")
        fresh, reused_fresh = warm_ranks(SETUP, form_group, summed)
        assert not reused_fresh and not set(pids) & {r["pid"] for r in fresh.run(1.0)}
        other, reused_other = warm_ranks(RankSetup(2, "cpu", 1, "gloo", 30), form_group, summed)
        assert not reused_other and not fresh.alive  # another setup: the old ranks are closed first
    finally:
        close_warm_ranks()


def test_inputs_are_read_again_only_when_their_source_changes(tmp_path, compose_cfg):
    """A sweep worker (or a warm rank) reads data and tokenizer once, and again when a file or setting changes."""
    base = ["model=tiny_lychee", "loss=pointwise", "data.train_group_size=4"]
    cfg = to_run_config(compose_cfg(base, tmp_path))
    first = load_inputs(cfg)
    assert load_inputs(cfg) is first
    assert load_inputs(to_run_config(compose_cfg([*base, "data.batch_size=1"], tmp_path))) is first  # not read
    lines = resolve_path(cfg.data.train_file, "data.train_file").read_text().splitlines(keepends=True)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(lines))
    moved = to_run_config(compose_cfg([*base, f"data.train_file={train}"], tmp_path))
    copy = load_inputs(moved)
    assert copy is not first and len(copy.train_queries) == len(first.train_queries)
    assert load_inputs(moved) is copy
    train.write_text("".join(lines[:5]))  # the file rewritten between two jobs: read again
    assert len(load_inputs(moved).train_queries) == 5


def test_dev_pairs_and_their_reference_metrics_are_built_once_per_process(tmp_path, compose_cfg, monkeypatch):
    """A warm trial reuses the dev pairs (tokenized) and their BM25 figures: they were most of its setup. Another
    seed or instruction (another candidate order or prompt) builds new ones, equal to a fresh build."""
    from lychee_exp.data.groups import build_dev_pairs
    from lychee_exp.ir import evaluate as ev

    cfg = to_run_config(compose_cfg(["model=tiny_lychee", "loss=pointwise", "data.max_dev_queries=6"], tmp_path))
    inputs = load_inputs(cfg)
    pairs = inputs.dev_pairs("judge", 1)
    assert inputs.dev_pairs("judge", 1) is pairs
    other_seed, other_instruction = inputs.dev_pairs("judge", 2), inputs.dev_pairs("rank", 1)
    assert other_seed is not pairs and other_instruction is not pairs
    assert other_seed == build_dev_pairs(inputs.dev_queries, inputs.encoder, "judge", 2)
    assert other_instruction.token_ids != pairs.token_ids  # the instruction is in every prompt
    calls = []
    bm25 = ev.bm25_scores
    monkeypatch.setattr(ev, "bm25_scores", lambda p: calls.append(p) or bm25(p))
    first = ev.reference_metrics(pairs)
    assert ev.reference_metrics(pairs) == first and len(calls) == 1
    assert ev.reference_metrics(other_seed) == first and len(calls) == 2  # same pairs, another order


def test_what_an_import_sets_in_the_environment_keeps_the_warm_ranks():
    """sklearn (loaded by optuna's fANOVA importances when the sweep writes its results after a trial) sets two
    KMP_ variables in the sweep process; a variable the user sets (hydra.job.env_set, e.g. NCCL_ALGO) still
    means new ranks, and what a job hands over itself (LYCHEE_*) never does."""
    from lychee_exp.launch.launcher import startup_environ

    pytest.importorskip("sklearn")

    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    imported = subprocess.run(
        [sys.executable, "-c", "import os, sklearn; print(os.environ.get('KMP_INIT_AT_FORK'))"],
        env=base,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert imported == "FALSE"  # the import does set it (else this test would prove nothing)
    after = {**base, "KMP_INIT_AT_FORK": "FALSE", "KMP_DUPLICATE_LIB_OK": "True", "LYCHEE_FAULT": "1:2:oom"}
    assert startup_environ(after) == startup_environ(base)
    assert startup_environ({**base, "NCCL_ALGO": "Ring"}) != startup_environ(base)


# ------------------------------------------------------------------------------------------ real sweeps
SWEEP = [
    *TINY_RANKS,
    "parallel=ddp",
    "gpus=2",
    "trainer.save_model=false",
    # these sweeps search the per-device batch (lr_batch's global batch is test_device_slots')
    "trainer.global_batch_size=null",
    "trainer.measure_speedup=false",
    "hydra.sweeper.heartbeat_interval=1",
    "hydra.sweeper.pruner._target_=optuna.pruners.NopPruner",
    "~hydra.sweeper.pruner.n_startup_trials",
    "~hydra.sweeper.pruner.n_warmup_steps",
]


def _sweep_args(sweep_dir: Path, *args: str) -> list[str]:
    return ["-m", "hparams_search=lr_batch", *SWEEP, f"hydra.sweep.dir={sweep_dir}", *args]


def _sweep_env() -> dict:
    environ = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    environ.pop("LYCHEE_FAULT", None)
    return environ


def _sweep(sweep_dir: Path, *args: str, env: dict | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", *_sweep_args(sweep_dir, *args)],
        cwd=sweep_dir.parent,
        env={**_sweep_env(), **(env or {})},
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def _rows(sweep_dir: Path) -> list[dict]:
    with (sweep_dir / "trials.csv").open() as handle:
        return list(csv.DictReader(handle))


OUTCOME = ("model_ndcg@10", "ndcg@10", "mrr@10", "train_loss", "initial_ndcg@10", "steps", "effective_batch_size")


@pytest.mark.slow
def test_warm_trials_equal_fresh_process_trials(tmp_path, capfd, monkeypatch):
    """The first two (lr, batch) points in the sampler's seeded order (they differ in both), on warm ranks and on
    fresh ranks per trial: the same metrics, and the warm sweep's second trial ran on the first one's ranks. The
    warm sweep is the command line; the fresh one runs in this process (its ranks start fresh either way, and
    the sweep command's start-up is the warm one's)."""
    from lychee_exp.run import main

    args = [
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",
        "optimizer.lr=choice(0.001,0.0003)",
        "data.batch_size=choice(1,2)",
        "data.num_workers=1",  # a rank's DataLoader workers are its children: a warm rank must be able to have them
    ]
    warm, fresh = tmp_path / "warm", tmp_path / "fresh"
    warm_proc = _sweep(warm, *args)
    for key, value in _sweep_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LYCHEE_FAULT", raising=False)
    fresh_args = ["lychee_exp.run", *_sweep_args(fresh, *args, "parallel.warm_ranks=false")]
    for proc in (warm_proc, run_in_process(main, fresh_args, tmp_path, capfd, monkeypatch, 400)):
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for number in range(2):
        w, f = run_metrics(warm / str(number)), run_metrics(fresh / str(number))
        assert w["base_lr"] == f["base_lr"] and w["per_device_batch_size"] == f["per_device_batch_size"]
        assert {k: w[k] for k in OUTCOME} == pytest.approx({k: f[k] for k in OUTCOME}, abs=1e-6), number
        assert w["warm_ranks"] == (number > 0) and "warm_ranks" not in f
        # each trial's rank logs hold that trial only: one set-up line, and its own learning rate
        rank0 = (warm / str(number) / "logs" / "warm" / "0" / "stderr.log").read_text()
        assert rank0.count("effective batch") == 1 and f"(base {w['base_lr']:.3g} at batch" in rank0, rank0
        assert (warm / str(number) / "logs" / "warm" / "1" / "stderr.log").is_file()
        # each step's loss and pre-clip gradient norm: a gradient scaled on reused ranks shows here
        assert_same_training(warm / str(number), fresh / str(number), weights=False)
    # the reused ranks got another learning rate and another batch shape
    assert len({run_metrics(warm / str(n))["base_lr"] for n in range(2)}) == 2
    assert {run_metrics(warm / str(n))["per_device_batch_size"] for n in range(2)} == {1, 2}
    rows, fresh_rows = _rows(warm), _rows(fresh)
    assert [r["warm_ranks"] for r in rows] == ["False", "True"]
    assert all(0 <= float(r["overhead_s"]) < float(r["duration_s"]) for r in rows)
    # the point of warm ranks: trial 1 pays less than half the start-up of the same trial on fresh ranks
    warm_overhead, fresh_overhead = float(rows[1]["overhead_s"]), float(fresh_rows[1]["overhead_s"])
    assert warm_overhead < 0.5 * fresh_overhead, (warm_overhead, fresh_overhead)


# One sweep shows every kind of failed trial, each in a trial of its own (faults: several
# comma-separated faults): trial 0 runs out of memory at batch 2 (step 1, rank 0) and is retried; trials 2 and 4
# raise and are killed (step 2, rank 1), each on the ranks that the trial before it kept.
FAULTS = "0:1:oom:0:2,1:2:raise:2,1:2:kill:4"
FAILED = {"raise": 2, "kill": 4}


@pytest.fixture(scope="module")
def faulty_sweep(tmp_path_factory) -> tuple[Path, str, optuna.Study]:
    sweep = tmp_path_factory.mktemp("faults") / "sweep"
    proc = _sweep(
        sweep,
        "hydra.sweeper.n_trials=6",
        "hydra.sweeper.max_failure_rate=0.5",
        "data.batch_size=2",
        env={"LYCHEE_FAULT": FAULTS},
        timeout=600,  # six trials, four of them on new ranks (three sweeps of 400 s before)
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    study = optuna.load_study(study_name="lr_batch", storage=f"sqlite:///{sweep / 'optuna.db'}")
    return sweep, proc.stdout + proc.stderr, study


@pytest.mark.slow
@pytest.mark.parametrize("fault, reason", [("raise", "crashed: rank 1 failed: RuntimeError"), ("kill", "SIGKILL")])
def test_a_failed_trial_is_followed_by_fresh_ranks(faulty_sweep, fault, reason):
    """LYCHEE_FAULT fires on rank 1 in one trial only: that trial fails with one reason, the sweep goes on, and
    the next trial starts new ranks and completes."""
    sweep, output, study = faulty_sweep
    failed = FAILED[fault]
    states = [t.state for t in study.trials]
    assert states[failed - 1 : failed + 2] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE], states
    assert reason in study.trials[failed].user_attrs["fail_reason"]
    assert "Traceback" not in output
    assert run_metrics(sweep / str(failed + 1))["warm_ranks"] is False
    assert "warm ranks of an earlier trial" in (sweep / str(failed) / "run.log").read_text()  # failed on reused ranks
    if fault == "raise":
        rank1 = (sweep / str(failed) / "logs" / "warm" / "1" / "stderr.log").read_text()
        assert "RuntimeError: injected fault" in rank1


@pytest.mark.slow
def test_an_oom_trial_retries_on_fresh_ranks_and_completes(faulty_sweep):
    """The injected OOM fires at batch 2 only (as a real one would): the retry with half the batch and twice the
    accumulation completes on new ranks, and its result is the trial's."""
    sweep, _, study = faulty_sweep
    assert [t.state for t in study.trials[:2]] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert study.trials[0].user_attrs["oom_retry"] == {"batch_size": 1, "grad_accum_steps": 2}
    assert "LYCHEE_FAULT oom fired" in (sweep / "0" / "logs" / "warm" / "0" / "stderr.log").read_text()
    assert "warm ranks, kept for the next trial" in (sweep / "0-oom-retry" / "run.log").read_text()  # new ranks
    retried = run_metrics(sweep / "0-oom-retry")
    assert (retried["per_device_batch_size"], retried["grad_accum_steps"], retried["steps"]) == (1, 2, 4)
    assert study.trials[0].value == pytest.approx(retried["model_ndcg@10"])
    assert run_metrics(sweep / "1")["warm_ranks"] is True  # the retry ended well: its ranks serve the next trial
    assert [t.number for t in study.trials if "oom_retry" in t.user_attrs] == [0]  # only the batch-2 run ran out
