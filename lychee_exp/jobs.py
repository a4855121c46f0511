"""Compose and run training jobs in-process, without Hydra's CLI (tests, benchmarks, stress scripts)."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_job(overrides: list[str], output_dir: Path) -> DictConfig:
    """The config `python -m lychee_exp.run <overrides>` would get, writing into output_dir."""
    import lychee_exp.run  # noqa: F401  (registers the schema and resolvers)

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="run"):
        return compose(config_name="config", overrides=[*overrides, f"output_dir={output_dir}"])


def run_job(overrides: list[str], output_dir: Path) -> float:
    from lychee_exp.run import run

    return run(compose_job(overrides, output_dir))
