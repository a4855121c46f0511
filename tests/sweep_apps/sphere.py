"""A plain Hydra app (no `trial` key) returning one float: the sphere function of hydra-optuna-sweeper's
example, for the conformance tests. `error=true` raises; `nan_below=v` returns NaN for x < v."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="sphere")
def sphere(cfg: DictConfig) -> float:
    if cfg.get("error", False):
        raise RuntimeError("cfg.error is True")
    if cfg.get("nan_below") is not None and cfg.x < cfg.nan_below:
        return float("nan")
    return cfg.x**2 + cfg.y**2


if __name__ == "__main__":
    sphere()
