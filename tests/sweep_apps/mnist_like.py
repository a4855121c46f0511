"""A small app of lightning-hydra-template's shape (train.yaml with an optional hparams_search group, the
task returning the metric named by `optimized_metric`), to run its mnist_optuna.yaml search config.
The "accuracy" is a smooth function of the hyperparameters, best near lr 0.01, batch 64 and wide layers."""

import math

import hydra
from omegaconf import DictConfig


def train(cfg: DictConfig) -> dict:
    lr_term = -((math.log10(cfg.model.optimizer.lr) + 2) ** 2) / 4
    batch_term = -abs(math.log2(cfg.datamodule.batch_size) - 6) / 10
    width = (cfg.model.net.lin1_size + cfg.model.net.lin2_size + cfg.model.net.lin3_size) / 768
    return {"val/acc_best": 0.9 + 0.05 * width + lr_term / 10 + batch_term / 10, "val/loss": 0.1}


@hydra.main(version_base="1.3", config_path="conf/mnist_like", config_name="train")
def main(cfg: DictConfig) -> float:
    return train(cfg)[cfg.optimized_metric]


if __name__ == "__main__":
    main()
