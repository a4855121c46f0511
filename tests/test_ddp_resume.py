"""Resume after SIGKILL on CPU ranks (gloo), plain and with length bucketing: the resumed run equals the
uninterrupted one; checkpoints are written atomically and pruned."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import run_metrics, warm_ranks_kept
from ddp_helpers import TINY_DDP, start_cli
from equivalence import assert_same_training

from lychee_exp.errors import RunFailed
from lychee_exp.job.in_process import run_job


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


def _killed_cli_run(args: list[str], killed: Path) -> None:
    """The CLI run killed (SIGKILL to the launcher) while rank 0 hangs after step 5, once step 4's checkpoint
    is on disk."""
    proc = start_cli([*args, f"hydra.run.dir={killed}"], killed.parent, env={"LYCHEE_FAULT": "0:5:hang"})
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "step_000004").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGKILL)  # the launcher alone: its ranks must die with it (PDEATHSIG)
    proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> dict[bool, tuple[Path, Path]]:
    """bucket -> (the uninterrupted run, the killed and resumed one). The plain run is killed through the CLI
    (its launcher); the bucketed one in this process, by a SIGKILL of rank 0 after step 5 (what its resume
    shows is the bucketed data order's restart, the kill is the plain case's). Every run in this process is
    on warm ranks: the resumes show the checkpoint's state, not a launch (the killed launch is the CLI's)."""
    root = tmp_path_factory.mktemp("resume")
    runs = {bucket: (root / f"uninterrupted-{bucket}", root / f"killed-{bucket}") for bucket in (False, True)}
    _killed_cli_run(_resume_args(False), runs[False][1])
    with warm_ranks_kept():
        for bucket, (reference, _) in runs.items():
            run_job(_resume_args(bucket), reference)
        with pytest.MonkeyPatch.context() as patch, pytest.raises(RunFailed, match="SIGKILL"):
            patch.setenv("LYCHEE_FAULT", "0:5:kill")
            run_job(_resume_args(True), runs[True][1])
        for bucket, (_, killed) in runs.items():
            assert (killed / "checkpoints" / "step_000004").is_dir() and not (killed / "metrics.json").exists()
            run_job([*_resume_args(bucket), "trainer.resume=auto"], killed)
    return runs


@pytest.mark.parametrize("bucket", [False, True], ids=["plain", "bucketed"])
def test_resume_after_sigkill_matches_uninterrupted_run(resume_runs, bucket):
    reference, killed = resume_runs[bucket]
    rank0_logs = [p.read_text() for p in killed.glob("logs/**/0/stderr.log")]
    assert sum("resumed from" in text for text in rank0_logs) == 1, rank0_logs
    m_ref, m_res = run_metrics(reference), run_metrics(killed)
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
