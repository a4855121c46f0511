"""Shared fixtures: in-process Hydra composition, tiny fast runs, and the CLI as a subprocess.

Runs are pinned to one intra-op thread: the machine has 2 cores, and torch's default of one thread per core
makes every process crawl (x10-x30) as soon as anything else runs beside it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence
from unittest import mock

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import lychee_exp
import lychee_exp.run  # noqa: F401  (registers the `lychee_schema` the primary config lists first)

REPO_ROOT = Path(lychee_exp.__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
ASSETS = Path(lychee_exp.__file__).resolve().parent / "assets"
TINY_QWEN2 = ASSETS / "tiny_qwen2"

# Seconds-long runs of the tiny random Qwen2 (Lychee's causal-LM code path) on the built-in sample data.
TINY_OVERRIDES = [
    "model=tiny_lychee",
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
]

torch.set_num_threads(1)


def compose_config(overrides: Sequence[str], output_dir: Path | str | None = None) -> DictConfig:
    """Composes conf/config.yaml as `python -m lychee_exp.run <overrides>` would, with the run directory at
    output_dir, and returns the task config Hydra would hand to main() (no `hydra` key)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.output_dir = str(output_dir)
        HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # Hydra strips it from the config the task function receives
    return cfg


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """compose_cfg(overrides, tmp_path) -> a ready DictConfig whose output_dir is tmp_path."""
    yield compose_config
    GlobalHydra.instance().clear()


@pytest.fixture
def tiny_cfg(tmp_path) -> DictConfig:
    return compose_config(TINY_OVERRIDES, tmp_path)


def run_job(overrides: Sequence[str], output_dir: Path) -> tuple[float, dict]:
    """Runs one job in-process; returns run()'s value and the metrics.json it wrote."""
    cfg = compose_config(overrides, output_dir)
    # parallel=single on CPU takes every core; keep to one thread on this shared 2-core machine
    with mock.patch("lychee_exp.devices.available_cores", return_value=1):
        value = lychee_exp.run.run(cfg)
    metrics = json.loads((Path(output_dir) / "metrics.json").read_text())
    return value, metrics


def run_tiny(output_dir: Path, *extra: str) -> tuple[float, dict]:
    return run_job([*TINY_OVERRIDES, *extra], output_dir)


def run_cli(args: Sequence[str], run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m lychee_exp.run <args> hydra.run.dir=<run_dir>` from a scratch directory."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-m", "lychee_exp.run", *args, f"hydra.run.dir={run_dir}"],
                          cwd=str(run_dir.parent), env=env, capture_output=True, text=True, timeout=timeout)


def output_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
