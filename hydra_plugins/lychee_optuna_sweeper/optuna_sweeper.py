"""hydra-optuna-sweeper's class name under this plugin's package: a config or test written for upstream
(`_target_: hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper`, lightning-hydra-template's
mnist_optuna.yaml) ports by renaming hydra_optuna_sweeper to lychee_optuna_sweeper. Same sweeper, same config."""

from .sweeper import LycheeOptunaSweeper


class OptunaSweeper(LycheeOptunaSweeper):
    """The lychee_optuna sweeper under hydra-optuna-sweeper's class name."""
