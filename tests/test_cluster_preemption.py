"""Preemption and damaged checkpoints: a signal stops a run with a checkpoint and the resume finishes it, on the
command line and through submitit's requeue (the same run directory); a truncated latest checkpoint falls back
to the one before."""

from __future__ import annotations

import signal

import pytest
import torch
from cluster_helpers import TINY_MULTI, start_until_step_2
from conftest import run_metrics

from lychee_exp.job.in_process import run_job


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
    assert run_metrics(tmp_path)["steps"] == 6


@pytest.mark.slow
def test_signal_stops_with_a_checkpoint_and_resume_finishes(tmp_path):
    run_dir = tmp_path / "run"
    train = [*TINY_MULTI, "parallel=ddp", "gpus=2", "trainer.max_steps=30", "trainer.measure_speedup=false"]
    proc = start_until_step_2([*train, f"hydra.run.dir={run_dir}"], tmp_path, "run/logs/**/0/stderr.log", 180)
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
    assert run_metrics(run_dir)["steps"] == 30


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
    proc = start_until_step_2(args, tmp_path, "sweep/0/logs/**/0/stderr.log", timeout_s=240)
    [controller] = [int(p.name) for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    [task] = [c for c in psutil.Process(controller).children() if "submitit.core._submit" in " ".join(c.cmdline())]
    task.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    job_log = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.*"))
    assert "Requeued job" in job_log and "resumed from" in (sweep / "0" / "run.log").read_text()
    assert run_metrics(sweep / "0")["steps"] == 60
