"""LycheeOptunaSweeper, the class Hydra instantiates for `hydra/sweeper=lychee_optuna`: a thin shell.

Hydra imports every module of the hydra_plugins package on each start, sweep or not, so this one stays cheap:
the implementation (lychee_exp.sweep.sweeper: optuna, the study, the trials) is imported once, when a sweep
actually builds the sweeper.
"""

from typing import Any, List

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class LycheeOptunaSweeper(Sweeper):
    def __init__(self, **config: Any) -> None:
        from lychee_exp.sweep.sweeper import LycheeOptunaSweeperImpl

        self.sweeper = LycheeOptunaSweeperImpl(**config)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> None:
        self.sweeper.sweep(arguments)
