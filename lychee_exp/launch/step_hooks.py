"""The per-step hooks a rank hands the recipe: the preemption stop (a collective, same answer on every rank) and,
in tests only, a fault injector named by the environment.

LYCHEE_STEP_HOOK=<module>:<factory> names a factory (rank, trial number, per-device batch size) -> callable(step,
model) or None; the test suite points it at faults:fault_hook, so the library itself never imports
test support.
"""

from __future__ import annotations

import importlib
import os
from functools import partial
from pathlib import Path

from lychee_exp.errors import UserError
from lychee_exp.launch.preemption import stop_requested
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.train.progress import StepHooks

STEP_HOOK_ENV = "LYCHEE_STEP_HOOK"


def rank_hooks(output_dir: Path, env: DistEnv, trial_number: int = -1, batch_size: int = 0) -> StepHooks:
    return StepHooks(
        after_step=_named_hook(env.rank, trial_number, batch_size),
        stop_requested=partial(stop_requested, output_dir, env),
    )


def _named_hook(rank: int, trial_number: int, batch_size: int):
    spec = os.environ.get(STEP_HOOK_ENV)
    if not spec:
        return None
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise UserError(f"{STEP_HOOK_ENV}={spec}: {err}") from None
    return factory(rank, trial_number, batch_size)
