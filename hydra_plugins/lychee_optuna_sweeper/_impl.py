"""hydra-optuna-sweeper's `_impl` helpers under this plugin's package, with upstream's signatures and return
shapes (the work is done in lychee_exp.sweep.upstream, imported on the first call: this module stays cheap)."""

from typing import Any, Dict, List, Tuple


def create_optuna_distribution_from_override(override: Any) -> Any:
    """A parsed sweep override -> its optuna distribution; a plain override -> its value as a string."""
    from lychee_exp.sweep.upstream import distribution_from_override

    return distribution_from_override(override)


def create_params_from_overrides(arguments: List[str]) -> Tuple[Dict[str, Any], Dict[str, Any], List[str]]:
    """Override lines -> (distributions by key, fixed values by key as strings, deletion lines)."""
    from lychee_exp.sweep.upstream import params_from_overrides

    return params_from_overrides(arguments)
