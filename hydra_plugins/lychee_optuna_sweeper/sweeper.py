"""LycheeOptunaSweeper, the class Hydra instantiates for `hydra/sweeper=lychee_optuna`: a thin shell.

Hydra imports every module of the hydra_plugins package on each start, sweep or not, so this one stays cheap:
the implementation (optuna, the study, the trials) is imported once, when a sweep actually builds the sweeper.
"""

import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any, List

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class LycheeOptunaSweeper(Sweeper):
    def __init__(self, **config: Any) -> None:
        from ._impl import LycheeOptunaSweeperImpl

        self.sweeper = LycheeOptunaSweeperImpl(**config)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        return self.sweeper.sweep(arguments)


def _answer_for_the_old_plugin() -> None:
    """Configs written for hydra-optuna-sweeper (lightning-hydra-template's mnist_optuna.yaml) name its class in
    `hydra.sweeper._target_`; after switching the sweeper to lychee_optuna they should run unedited. Hydra
    instantiates a plugin by that name and checks that the name imports to the class, so while the old plugin
    is not installed its module path is registered (in this process only) holding this plugin under the old
    class name. Installed, the old plugin is never shadowed."""
    package = "hydra_plugins.hydra_optuna_sweeper"
    if package in sys.modules or importlib.util.find_spec(package) is not None:
        return
    name = f"{package}.optuna_sweeper"

    class OptunaSweeper(LycheeOptunaSweeper):
        def __init__(self, **config: Any) -> None:
            log.info(
                "hydra.sweeper._target_ names hydra-optuna-sweeper's OptunaSweeper (not installed): "
                "lychee_optuna runs the sweep"
            )
            super().__init__(**config)

    OptunaSweeper.__module__, OptunaSweeper.__qualname__ = name, "OptunaSweeper"
    for module_name in (package, name):
        module = types.ModuleType(module_name, "stands in for hydra-optuna-sweeper: see lychee_optuna_sweeper")
        module.__spec__ = importlib.machinery.ModuleSpec(module_name, None, is_package=module_name == package)
        sys.modules[module_name] = module
    sys.modules[package].__path__ = []
    sys.modules[package].optuna_sweeper = sys.modules[name]
    sys.modules[name].OptunaSweeper = OptunaSweeper
    globals()["_OldPluginName"] = OptunaSweeper  # Hydra's plugin scan registers it (under the old name)


_answer_for_the_old_plugin()
