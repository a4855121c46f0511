"""The search space: hydra-optuna-sweeper's `params` grammar turned into optuna distributions.

Every mistake is a UserError naming the key, raised before the first trial, so that a typo costs seconds and
not a trial's worth of GPU time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from lychee_exp.errors import UserError

_NOT_FOUND = object()


@dataclass
class SearchSpace:
    distributions: dict[str, Any]  # optuna BaseDistribution per override key
    fixed: list[str] = field(default_factory=list)  # overrides every trial gets
    custom: Callable[[DictConfig, Any], None] | None = None  # custom_search_space

    def params(self, trial: Any, config: DictConfig) -> dict[str, Any]:
        """The trial's parameters: the distributions' (asked with the trial), then custom_search_space's."""
        if self.custom is not None:
            self.custom(config, trial)
        return dict(trial.params)

    def overrides(self, params: Mapping[str, Any]) -> list[str]:
        return [*self.fixed, *(f"{key}={render(value)}" for key, value in params.items())]


def build_space(params: Mapping[str, Any] | None, arguments: Sequence[str], config: DictConfig,
                custom_search_space: str | None, parser: Any) -> SearchSpace:
    """params (hydra.sweeper.params) and the command line's sweep overrides -> SearchSpace; the command
    line's other overrides are fixed and go to every trial, as with Hydra's basic sweeper."""
    distributions: dict[str, Any] = {}
    fixed: dict[str, str] = {}  # key -> override line; the command line wins over params for a key
    lines = [(f"hydra.sweeper.params.{key}", f"{key}={value}") for key, value in (params or {}).items()]
    lines += [("", argument) for argument in arguments]  # the command line
    for where, line in lines:
        try:
            override = parser.parse_override(line)
        except Exception as err:  # Hydra's grammar errors: keep their first line, which says what is wrong
            raise UserError(f"{where or 'command line'}: {line!r}: {str(err).splitlines()[0]}") from None
        key = override.get_key_element()
        where = where or f"{key} (command line)"
        distributions.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override() or where.startswith("hydra."):  # Hydra checked the command line's others
            _check_key(key, config, where)
        if override.is_sweep_override():
            distributions[key] = to_distribution(where, override)
        else:
            fixed[key] = line
    space = SearchSpace(distributions, list(fixed.values()))
    if custom_search_space:
        space.custom = _import_function(custom_search_space)
    if not space.distributions and space.custom is None:
        raise UserError("hydra.sweeper.params: nothing to search (give params, sweep overrides such as "
                        "optimizer.lr='tag(log, interval(1e-5, 1e-3))', or custom_search_space)")
    return space


def to_distribution(where: str, override: Any) -> Any:
    import optuna.distributions as od

    value = override.value()
    if override.is_choice_sweep() or override.is_range_sweep():
        # range(a, b, step) is a choice among its values, as in hydra-optuna-sweeper
        choices = list(override.sweep_iterator())
        if not choices:
            raise UserError(f"{where}: {override.get_value_string()!r} has no values")
        for choice in choices:
            if choice is not None and not isinstance(choice, (bool, int, float, str)):
                raise UserError(f"{where}: choice {choice!r} is not a number, string, bool or null")
        return od.CategoricalDistribution(choices)
    if override.is_interval_sweep():
        low, high, tags = value.start, value.end, value.tags
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise UserError(f"{where}: interval({low:g}, {high:g}) needs low < high")
        log = "log" in tags
        if log and low <= 0:
            raise UserError(f"{where}: a log interval needs low > 0, got {low:g}")
        if "int" in tags:
            return od.IntDistribution(int(low), int(high), log=log)
        return od.FloatDistribution(low, high, log=log)
    raise UserError(f"{where}: {override.get_value_string()!r}: unsupported sweep (use interval, "
                    "tag(log, interval), choice or range)")


def render(value: Any) -> str:
    """A Python value as Hydra override grammar (strings quoted, so '3' stays a string and 'a b' one value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{key}:{render(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render(item) for item in value) + "]"
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def _check_key(key: str, config: DictConfig, where: str) -> None:
    if key.startswith("+") or key.startswith("~"):  # additions and deletions: Hydra checks them per job
        return
    if key in OmegaConf.select(config, "hydra.runtime.choices", default={}):  # a config group, e.g. model
        return
    if key.startswith("trial.") or key in ("hydra.sweep.dir", "hydra.sweep.subdir"):
        raise UserError(f"{where}: {key} is set by the sweeper for each trial and cannot be searched")
    if OmegaConf.select(config, key, default=_NOT_FOUND, throw_on_missing=False) is _NOT_FOUND:
        raise UserError(f"{where}: {key!r} is not a key of the composed config (misspelt? a new key needs '+')")


def _import_function(path: str) -> Callable:
    from hydra.utils import get_method

    try:
        return get_method(path)
    except Exception as err:
        raise UserError(f"hydra.sweeper.custom_search_space={path}: {str(err).splitlines()[0]}") from None
