"""A plain Hydra app whose search space is extended in Python (custom_search_space), as in
hydra-optuna-sweeper's custom-search-space example: z is drawn near x, and w is a new key (+w)."""

import hydra
from omegaconf import DictConfig
from optuna.trial import Trial


@hydra.main(version_base="1.3", config_path="conf", config_name="custom_search_space")
def multi_dimensional_sphere(cfg: DictConfig) -> float:
    return cfg.w**2 + cfg.x**2 + cfg.y**2 + cfg.z**2


def configure(cfg: DictConfig, trial: Trial) -> None:
    x = trial.params["x"]
    trial.suggest_float("z", x - cfg.max_z_difference_from_x, x + cfg.max_z_difference_from_x)
    trial.suggest_float("+w", 0.0, 1.0)  # +w: w is not in the config


if __name__ == "__main__":
    multi_dimensional_sphere()
