"""What the cluster tests share (test_cluster, test_cluster_preemption, test_cluster_sweeps, test_cluster_slurm,
test_cluster_failures): the tiny Lychee model on 2 ranks, an environment without the machine's own SLURM
variables, a CLI run watched until training has begun, and the skip where Slurm cannot be installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_RANKS

from tools.local_slurm import INSTALL, missing_binaries

# The tiny Lychee model, fp32, as tests/test_ddp.py: 2 ranks x batch 2 on any launch path must agree.
TINY_MULTI = [
    *TINY_RANKS,
    "data.random_negatives=0",
    "data.batch_size=2",
    "optimizer.lr=1e-3",
    "trainer.save_model=false",
]


def cluster_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.pop("PYTHONWARNINGS", None)
    return {**env, "HYDRA_FULL_ERROR": "0", **extra}


def start_until_step_2(args: list[str], cwd: Path, rank0_logs: str, timeout_s: float, **env: str) -> subprocess.Popen:
    """`python -m lychee_exp.run <args>` (env: more variables), returned once rank 0's log (the glob under cwd)
    shows step 2."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=cwd,
        env=cluster_env(**env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout_s
    while not any("step 2/" in p.read_text() for p in cwd.glob(rank0_logs)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()  # not left behind by a failing test (a submitter would wait for its job for ever)
            raise AssertionError(f"training did not start:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.2)
    return proc


def require_slurm() -> None:
    """Skips where Slurm/munge are missing and this user cannot install them; fails where they could be."""
    missing = missing_binaries()
    if missing and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip(f"no {', '.join(missing)}, and this user cannot install them ({INSTALL} needs root)")
    assert not missing, f"no {', '.join(missing)} on this host: {INSTALL} (bash .ci/run does it)"
