"""The search space: hydra-optuna-sweeper's `params` grammar turned into the same optuna distributions.

Every mistake is a UserError naming the key, raised before the first trial, so that a typo costs seconds and
not a trial's worth of GPU time. Mapping (as hydra-optuna-sweeper's): choice and shuffle(range) are
categorical; range(a, b[, step]) is an IntDistribution with b included, or a FloatDistribution with that step
when a bound or the step is a float; interval is float, or int when both bounds are ints (after an int() cast);
tag(log, ...) samples on a log scale. Added here: tag(int, interval) is an int interval and glob over a config
group is a choice among its options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import optuna
from hydra.core.override_parser.types import ChoiceSweep, Glob, IntervalSweep, RangeSweep
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from lychee_exp.errors import UserError

_NOT_FOUND = object()


@dataclass
class SearchSpace:
    distributions: dict[str, Any]  # optuna BaseDistribution per override key
    fixed: dict[str, str] = field(default_factory=dict)  # key -> override line every trial gets
    custom: Callable[[DictConfig, Any], None] | None = None  # custom_search_space
    custom_path: str = ""

    def suggest(self, trial: Any) -> None:
        """Draws the trial's value of every distribution (the sampler runs here), as study.ask(distributions)
        would; the sweeper calls it once the trial is claimed."""
        for key, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                trial.suggest_categorical(key, dist.choices)
            elif isinstance(dist, IntDistribution):
                trial.suggest_int(key, dist.low, dist.high, step=dist.step, log=dist.log)
            else:
                trial.suggest_float(key, dist.low, dist.high, step=dist.step, log=dist.log)

    def params(self, trial: Any, config: DictConfig) -> dict[str, Any]:
        """The trial's parameters: the distributions' (suggest() drew them), then custom_search_space's."""
        if self.custom is not None:
            self.custom(config, trial)
            overlap = sorted(_bare(key) for key in trial.params if _bare(key) in map(_bare, self.fixed))
            if overlap:  # a fixed override would be silently replaced: hydra-optuna-sweeper refuses it too
                raise UserError(
                    f"hydra.sweeper.custom_search_space={self.custom_path} suggests {overlap}, which "
                    "the command line or params fix: drop the fixed value or the suggestion"
                )
        return dict(trial.params)

    def try_custom(self, config: DictConfig, directions: list[str]) -> list[str]:
        """custom_search_space runs once on a throwaway trial: a broken function, or a suggestion that a fixed
        override would silently replace, stops the sweep before its first trial. Returns the keys it suggested
        (searched, so no part of the study's fixed config)."""
        if self.custom is None:
            return []
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study created in memory" line
        try:
            study = optuna.create_study(directions=directions, sampler=optuna.samplers.RandomSampler())
            trial = study.ask()
            self.suggest(trial)
            return sorted(self.params(trial, config))
        except UserError:
            raise
        except Exception as err:
            message = str(err).splitlines()[0] if str(err) else ""
            raise UserError(
                f"hydra.sweeper.custom_search_space={self.custom_path}: {type(err).__name__}: {message}"
            ) from None
        finally:
            optuna.logging.set_verbosity(verbosity)

    def overrides(self, params: Mapping[str, Any]) -> list[str]:
        return [*self.fixed.values(), *(f"{key}={render(value)}" for key, value in params.items())]

    def sample_overrides(self) -> list[str]:
        """The sample trial's overrides: a value from every distribution (the first choice, or the low end)."""
        sample = {
            k: d.choices[0] if isinstance(d, CategoricalDistribution) else d.low for k, d in self.distributions.items()
        }
        return self.overrides(sample)

    def grid(self) -> dict[str, list]:
        """GridSampler's search space: every value each distribution can take (a continuous one cannot)."""
        return {key: _grid_values(key, d) for key, d in self.distributions.items()}


def build_space(
    params: Mapping[str, Any] | None,
    arguments: Sequence[str],
    config: DictConfig,
    custom_search_space: str | None,
    parser: Any,
) -> SearchSpace:
    """params (hydra.sweeper.params) and the command line's sweep overrides -> SearchSpace; the command
    line's other overrides are fixed and go to every trial, as with Hydra's basic sweeper. For a key given
    twice the command line wins (over params), as in hydra-optuna-sweeper."""
    distributions: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    # a null param fixes the key to null (hparams_search=lr_tokens turns lr_batch's global batch off so)
    lines = [
        (f"hydra.sweeper.params.{key}", f"{key}={'null' if value is None else value}")
        for key, value in (params or {}).items()
    ]
    lines += [("", argument) for argument in arguments]  # the command line
    for where, line in lines:
        try:
            override = parser.parse_override(line)
            override.config_loader = parser.config_loader  # for glob (parse_override leaves it out)
        except Exception as err:  # Hydra's grammar errors: keep their first line, which says what is wrong
            raise UserError(f"{where or 'command line'}: {line!r}: {str(err).splitlines()[0]}") from None
        if override.is_delete():  # ~key: every trial drops the key
            fixed[line] = line
            continue
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
    space = SearchSpace(distributions, fixed)
    if custom_search_space:
        space.custom, space.custom_path = _import_function(custom_search_space), custom_search_space
    return space  # nothing to search is allowed: the trials then run the fixed config (as upstream)


def to_distribution(where: str, override: Any) -> Any:
    value = override.value()
    text = override.get_value_string()
    try:
        if isinstance(value, IntervalSweep):
            return _interval(where, value)
        if isinstance(value, RangeSweep) and not value.shuffle:
            return _range(where, value)
        if isinstance(value, (ChoiceSweep, RangeSweep, Glob)):
            return _categorical(where, text, list(override.sweep_iterator()))
    except ValueError as err:  # optuna's own checks, e.g. `low > 0` must hold for log=True
        raise UserError(f"{where}: {text!r}: {str(err).splitlines()[0]}") from None
    raise UserError(f"{where}: {text!r}: unsupported sweep (use choice, range, interval or tag(log, interval))")


def _interval(where: str, value: IntervalSweep) -> Any:
    low, high, log = value.start, value.end, "log" in value.tags
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise UserError(f"{where}: interval({low:g}, {high:g}) needs low < high")
    if log and low <= 0:
        raise UserError(f"{where}: a log interval needs low > 0, got {low:g}")
    if (isinstance(low, int) and isinstance(high, int)) or "int" in value.tags:
        return IntDistribution(int(low), int(high), log=log)
    return FloatDistribution(low, high, log=log)


def _range(where: str, value: RangeSweep) -> Any:
    start, stop, step = value.start, value.stop, value.step
    if not step or step <= 0 or start > stop:
        raise UserError(
            f"{where}: range({start}, {stop}, step={step}) needs start <= stop and step > 0 "
            "(the stop is included, as in hydra-optuna-sweeper)"
        )
    if any(isinstance(v, float) for v in (start, stop, step)):
        return FloatDistribution(float(start), float(stop), step=float(step), log="log" in value.tags)
    return IntDistribution(int(start), int(stop), step=int(step), log="log" in value.tags)


def _categorical(where: str, text: str, choices: list) -> Any:
    if not choices:
        raise UserError(f"{where}: {text!r} has no values")
    for choice in choices:
        if choice is not None and not isinstance(choice, (bool, int, float, str)):
            raise UserError(f"{where}: choice {choice!r} is not a number, string, bool or null")
    return CategoricalDistribution(choices)


def _grid_values(key: str, d: Any) -> list:
    if isinstance(d, CategoricalDistribution):
        return list(d.choices)
    if isinstance(d, IntDistribution) and not d.log:
        return list(range(d.low, d.high + 1, d.step))
    if isinstance(d, FloatDistribution) and d.step is not None:
        count = int(round((d.high - d.low) / d.step)) + 1
        return [d.low + i * d.step for i in range(count)]
    raise UserError(
        f"hydra.sweeper.params.{key}: the grid sampler needs a finite set of values (choice or "
        "range), not a continuous interval"
    )


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


def _bare(key: str) -> str:
    return key.lstrip("+~")


def _check_key(key: str, config: DictConfig, where: str) -> None:
    if key.startswith("+") or key.startswith("~"):  # additions and deletions: Hydra checks them per job
        return
    if key in OmegaConf.select(config, "hydra.runtime.choices", default={}):  # a config group, e.g. model
        return
    if key in ("hydra.sweep.dir", "hydra.sweep.subdir"):
        raise UserError(f"{where}: {key} is set by the sweeper for each trial and cannot be searched")
    if OmegaConf.select(config, key, default=_NOT_FOUND, throw_on_missing=False) is _NOT_FOUND:
        raise UserError(f"{where}: {key!r} is not a key of the composed config (misspelt? a new key needs '+')")


def _import_function(path: str) -> Callable:
    try:
        return get_method(path)
    except Exception as err:
        raise UserError(f"hydra.sweeper.custom_search_space={path}: {str(err).splitlines()[0]}") from None


def legacy_as_params(search_space: dict) -> str:
    """The old `search_space` entries ({type, choices | low, high, step, log}) in the params grammar. A float
    entry keeps float bounds (`interval(0, 10)` and `range(0, 10, step=2)` would be int distributions)."""
    lines = []
    for key, spec in search_space.items():
        spec = spec if isinstance(spec, dict) else {}
        if spec.get("type") == "categorical":
            lines.append(f"{key}: choice({', '.join(render(c) for c in spec.get('choices', []))})")
            continue
        as_float = spec.get("type") == "float"
        low, high, step = (_legacy_number(spec.get(k), as_float) for k in ("low", "high", "step"))
        if spec.get("step") and not spec.get("log"):
            value = f"range({low}, {high}, step={step})"
        else:
            value = f"interval({low}, {high})" if as_float else f"int(interval({low}, {high}))"
            value = f"tag(log, {value})" if spec.get("log") else value
        lines.append(f"{key}: {value}")
    return "; ".join(lines)


def _legacy_number(value: Any, as_float: bool) -> str:
    if as_float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return str(value)
