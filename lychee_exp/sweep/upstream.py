"""hydra-optuna-sweeper's two module-level helpers, with its return shapes, on this project's grammar mapping
(space.to_distribution), so that code and tests written against `hydra_optuna_sweeper._impl` run against
`lychee_optuna_sweeper._impl` (which forwards here). No config is at hand in these calls: keys are not checked,
and glob over a config group cannot be expanded.
"""

from __future__ import annotations

from typing import Any, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from optuna.distributions import BaseDistribution

from lychee_exp.errors import UserError
from lychee_exp.sweep.space import to_distribution


def distribution_from_override(override: Override) -> Any:
    """A sweep override -> its optuna distribution; any other override -> its value as a string."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    try:
        return to_distribution(override.get_key_element(), override)
    except UserError as err:  # upstream raises a plain exception for a sweep it cannot map
        raise ValueError(str(err)) from None


def params_from_overrides(
    arguments: Sequence[str],
) -> tuple[dict[str, BaseDistribution], dict[str, Any], list[str]]:
    """Override lines -> (distributions, fixed values as strings, deletion lines), by key."""
    distributions: dict[str, BaseDistribution] = {}
    fixed: dict[str, Any] = {}
    deletions: list[str] = []
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        if override.is_delete():
            deletions.append(str(override.input_line))
            continue
        value = distribution_from_override(override)
        target = distributions if isinstance(value, BaseDistribution) else fixed
        target[override.get_key_element()] = value
    return distributions, fixed, deletions
