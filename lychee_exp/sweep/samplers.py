"""The study's sampler and pruner from their `_target_` specs, with one-line errors for every mistake.

A null argument means "the class's own default" and is not passed, so that the sampler group's configs
(hydra/sweeper/sampler: tpe, random, cmaes, ...) can list every argument and `sampler._target_=` can still
switch to a class that lacks some of them.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Mapping

import optuna
from hydra.utils import instantiate

from lychee_exp.errors import UserError

MOTPE = (
    "optuna.samplers.MOTPESampler",
    "hydra_plugins.lychee_optuna_sweeper.config.raise_motpe_removed",
    "hydra_plugins.hydra_optuna_sweeper.config.raise_motpe_removed",
)
GRID = "optuna.samplers.GridSampler"


def build_sampler(spec: Mapping[str, Any], grid_space: Any, seed_shift: int = 0) -> Any:
    """grid_space: a callable giving GridSampler's search space from `params` (unless the spec has one)."""
    spec = _given(spec)
    if spec.get("_target_") in MOTPE or str(spec.get("_target_", "")).endswith("motpe_removed"):
        raise UserError(
            "hydra.sweeper.sampler: the 'motpe' sampler was removed in Optuna 4.0 (MOTPESampler); use "
            "hydra/sweeper/sampler=tpe, whose TPESampler handles multi-objective studies"
        )
    if spec.get("_target_") == GRID and "search_space" not in spec:
        spec["search_space"] = grid_space()
    if seed_shift and spec.get("seed") is not None:
        spec["seed"] += seed_shift
    return _instantiate("sampler", spec, optuna.samplers.BaseSampler, "TPESampler")


def build_pruner(spec: Mapping[str, Any] | None) -> Any:
    if not spec:  # null: never prune
        return optuna.pruners.NopPruner()
    return _instantiate("pruner", _given(spec), optuna.pruners.BasePruner, "MedianPruner")


def _given(spec: Mapping[str, Any]) -> dict:
    return {key: value for key, value in dict(spec).items() if value is not None or key == "_target_"}


def _instantiate(key: str, spec: dict, base: type, example: str) -> Any:
    target = spec.get("_target_")
    if not _importable(str(target)):
        raise UserError(f"hydra.sweeper.{key}._target_={target}: no such class (e.g. optuna.{key}s.{example})")
    try:
        with warnings.catch_warnings():  # "X is experimental": the user chose X
            warnings.simplefilter("ignore")
            obj = instantiate(spec)
    except Exception as err:
        cause = err.__cause__ or err
        message = str(cause).splitlines()[0] if str(cause).strip() else type(cause).__name__
        if isinstance(cause, ModuleNotFoundError):  # e.g. CmaEsSampler without the cmaes package
            message += " (the project's setup installs it: bash launch/setup_env.sh)"
        if "unexpected keyword" in message:  # a new _target_ merged with the old one's arguments
            message += f" (remove it with ~hydra.sweeper.{key}.<argument>)"
        raise UserError(f"hydra.sweeper.{key}: _target_={target}: {message}") from None
    if not isinstance(obj, base):
        raise UserError(f"hydra.sweeper.{key}._target_={target} is not an {base.__module__}.{base.__name__}")
    return obj


def _importable(path: str) -> bool:
    """Whether a dotted path names an object, without Hydra's lookup, which logs its failures as errors."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name, None)
        return obj is not None
    return False
