"""A plain Hydra app returning a tuple, one value per direction: Binh and Korn's two objectives, as in
hydra-optuna-sweeper's multi-objective example."""

from typing import Tuple

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="multi_objective")
def binh_and_korn(cfg: DictConfig) -> Tuple[float, float]:
    return 4 * cfg.x**2 + 4 * cfg.y**2, (cfg.x - 5) ** 2 + (cfg.y - 5) ** 2


if __name__ == "__main__":
    binh_and_korn()
