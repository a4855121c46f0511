"""Compose and run training jobs in this process, without Hydra's CLI: for notebooks and scripts, and the one helper
that the tests (conftest) and the repository's benchmarks use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from lychee_exp.config.schema import CONF_DIR
from lychee_exp.job.context import register_config
from lychee_exp.job.training_job import train_job

register_config()


def compose_job(overrides: Sequence[str], output_dir: Path | str | None = None) -> DictConfig:
    """The config `python -m lychee_exp.run <overrides>` would hand its task function, with the run directory
    at output_dir (Hydra's runtime state is set as a run would have it, so `${hydra:...}` resolves)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR, job_name="run"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.output_dir = str(output_dir)
        HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # Hydra strips it from the config the task function receives
    return cfg


def run_job(overrides: Sequence[str], output_dir: Path) -> tuple[float, dict]:
    """Runs one job in this process; returns what the task function returned (the optimized metric) and the
    metrics.json the run wrote."""
    value = train_job(compose_job(overrides, output_dir))
    return value, json.loads((Path(output_dir) / "metrics.json").read_text())
