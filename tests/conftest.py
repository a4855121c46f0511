"""Shared fixtures: in-process Hydra composition and runs (lychee_exp.job.in_process, the helper that benchmarks and
scripts use too), tiny fast runs, and the CLI as a subprocess.

Runs are pinned to one intra-op thread: the machine has 2 cores, and torch's default of one thread per core
makes every process crawl (x10-x30) as soon as anything else runs beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest
import torch
import yaml
from beir_helpers import ir_cache  # noqa: F401  (a fixture: a temporary LYCHEE_CACHE_DIR)
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

import lychee_exp
from lychee_exp.config.schema import CONF_DIR as _CONF_DIR
from lychee_exp.job.in_process import compose_job as compose_config
from lychee_exp.job.in_process import run_job
from lychee_exp.train import inputs

# Fault injection (LYCHEE_FAULT) reaches the ranks through the step hook the launcher looks up by name (tests/faults.py,
# outside the package: the product never names test code): every job the tests start, in this process or in
# subprocesses, inherits it, and the repository root (benchmarks, tools) and tests/ on the path that finds it.
os.environ.setdefault("LYCHEE_STEP_HOOK", "faults:fault_hook")
_TESTS_DIR = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(_TESTS_DIR.parent), str(_TESTS_DIR), os.environ.get("PYTHONPATH")])
)
# One speedup-baseline cache for the session, never the checkout's outputs/ (tests that need their own set it)
os.environ["LYCHEE_BASELINE_FILE"] = str(Path(tempfile.mkdtemp(prefix="lychee-baselines-")) / "b.json")

REPO_ROOT = Path(lychee_exp.__file__).resolve().parent.parent
CONF_DIR = Path(_CONF_DIR)
ASSETS = Path(lychee_exp.__file__).resolve().parent / "assets"
TINY_QWEN2 = ASSETS / "tiny_qwen2"

# Seconds-long runs of the tiny random Qwen2 (Lychee's causal-LM code path) on the built-in sample data.
TINY_OVERRIDES = [
    "model=tiny_lychee",
    "loss=pointwise",  # Lychee's loss (the default job's quickstart recipe is listwise + distillation)
    "parallel=single",
    "gpus=1",
    "data.max_train_queries=8",
    "data.max_dev_queries=3",
    "data.batch_size=2",
    "data.train_group_size=4",
    "data.random_negatives=0",  # the file's negatives only, as the expectations below were measured
    "data.eval_batch_size=32",
    "trainer.max_steps=4",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "trainer.precision=fp32",
    "logger=none",
    "optimizer.lr=1e-3",
    "optimizer.lr_scaling=none",
    "parallel.cpu_threads_per_rank=1",  # parallel=single on CPU would take every core
]

# The tiny Lychee model on several ranks (DDP, torchrun, SLURM, sweep trials), fp32: seconds per run.
TINY_RANKS = [
    "model=tiny_lychee",
    "loss=pointwise",
    "data.max_train_queries=16",
    "data.max_dev_queries=6",
    "data.train_group_size=4",
    "trainer.max_steps=4",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "trainer.precision=fp32",
    "optimizer.lr_scaling=none",
    "logger=csv",
]

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_inputs_cache():
    """lychee_exp.train.inputs keeps the last inputs a process read: each test starts without them."""
    inputs._last = None
    yield


@pytest.fixture
def no_wandb_key(monkeypatch, tmp_path):
    """No W&B API key anywhere (environment or ~/.netrc): runs go offline."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """compose_cfg(overrides, tmp_path) -> a ready DictConfig whose output_dir is tmp_path."""
    yield compose_config
    GlobalHydra.instance().clear()


@pytest.fixture
def tiny_cfg(tmp_path) -> DictConfig:
    return compose_config(TINY_OVERRIDES, tmp_path)


def run_metrics(run_dir: Path) -> dict:
    """The metrics.json a run wrote, whole (tests assert on keys the sweep's own reader leaves out)."""
    return json.loads((run_dir / "metrics.json").read_text())


def run_tiny(output_dir: Path, *extra: str) -> tuple[float, dict]:
    return run_job([*TINY_OVERRIDES, *extra], output_dir)


@contextlib.contextmanager
def warm_ranks_kept() -> Iterator[None]:
    """In-process DDP runs keep their ranks for the next run of the same setup, as a sweep's trials do
    (lychee_exp.launch.warm_ranks): for tests whose runs show training math, not the launch. The setup includes
    the environment, which pytest changes per test (PYTEST_CURRENT_TEST): ranks serve the runs of one test or
    fixture. Closed at the end, so that no other test inherits them."""
    from lychee_exp.launch.warm_ranks import close_warm_ranks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lychee_exp.job.training_job.trials_run_here", lambda: True)
        try:
            yield
        finally:
            close_warm_ranks()


def run_cli(args: Sequence[str], run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m lychee_exp.run <args> hydra.run.dir=<run_dir>` from a scratch directory."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", *args, f"hydra.run.dir={run_dir}"],
        cwd=str(run_dir.parent),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def output_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


@dataclasses.dataclass(frozen=True)
class DefaultJob:
    proc: subprocess.CompletedProcess
    run_dir: Path

    @property
    def metrics(self) -> dict:
        return run_metrics(self.run_dir)

    @property
    def run_log(self) -> str:
        return (self.run_dir / "run.log").read_text()

    @property
    def config(self) -> dict:
        return yaml.safe_load((self.run_dir / "config.yaml").read_text())


@pytest.fixture(scope="session")
def default_job(tmp_path_factory) -> DefaultJob:
    """`python -m lychee_exp.run` with nothing else, as `make run` runs it for a new user (no W&B key: offline):
    the built-in default job, minutes on CPU, run once a session for tests/test_default_job.py (what it learns) and
    tests/test_readme.py (README's figures and outputs list)."""
    tmp = tmp_path_factory.mktemp("default_job")
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env.update(HOME=str(tmp / "home"), WANDB_CONFIG_DIR=str(tmp / "wandb-config"))
    proc = subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", f"hydra.run.dir={tmp / 'run'}"],
        cwd=str(tmp),
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return DefaultJob(proc, tmp / "run")


@pytest.fixture
def postgres_url():
    """A throwaway PostgreSQL server on localhost (as the postgres user when run as root); its SQLAlchemy URL."""
    from benchmarks.local_postgres import local_postgres, server_bindir

    if server_bindir() is None:
        pytest.skip("PostgreSQL server binaries are not installed")
    pytest.importorskip("psycopg2")
    with local_postgres() as url:
        yield url


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Callable[[int], Path]]:
    """small_disk(kib) -> a directory on a file system of that many KiB (a tmpfs mounted for the test), to fill up
    on purpose: a full disk is ENOSPC from the kernel, not a fake. Skipped where mounting is not allowed."""
    import shutil as _shutil

    mounted: list[Path] = []

    def make(kib: int) -> Path:
        if os.geteuid() != 0 or _shutil.which("mount") is None:
            pytest.skip("a small file system needs root and mount(8)")
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
