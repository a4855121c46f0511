"""What a finished job means for its trial: COMPLETE with values, PRUNED, or FAIL with a reason.

A NaN metric, a diverged loss, an out-of-memory rank or a crash fail the trial; none of them stops the sweep
(hydra-optuna-sweeper crashes on a NaN return, Hydra issue 2237).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobStatus

from lychee_exp.errors import RunFailed, UserError
from lychee_exp.tracking.keys import TRIAL_METRICS


@dataclass
class Outcome:
    state: str  # COMPLETE | PRUNED | FAIL
    values: list[float] | None = None
    reason: str | None = None
    kind: str | None = None  # FAIL: diverged | oom | crashed | config | nan
    metrics: dict[str, Any] = field(default_factory=dict)


def read_metrics(run_dir: Path) -> dict[str, Any]:
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return {key: metrics[key] for key in TRIAL_METRICS if key in metrics}


def job_outcome(job_return: Any, run_dir: Path, n_objectives: int, objectives: Sequence[str] | None) -> Outcome:
    metrics = read_metrics(run_dir)
    if job_return.status != JobStatus.COMPLETED:
        try:
            _ = job_return.return_value  # re-raises the job's exception
        except RunFailed as err:
            return _failed(err.kind, str(err), metrics)
        except UserError as err:
            return _failed("config", str(err), metrics)
        except Exception as err:
            return _failed("crashed", f"{type(err).__name__}: {err}", metrics)
    if objectives:
        try:
            full = json.loads((run_dir / "metrics.json").read_text())
        except (OSError, ValueError):
            full = {}
        missing = [key for key in objectives if key not in full]
        if missing:
            return _failed("config", f"metrics.json has no {missing} (hydra.sweeper.objectives)", metrics)
        values = [full[key] for key in objectives]
    else:
        value = job_return.return_value  # a number, or a sequence of them (multi-objective), as upstream
        single = isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or getattr(value, "ndim", 1) == 0
        values = [value] if single else list(value)
    if len(values) != n_objectives:
        return _failed("config", f"the job gave {len(values)} value(s) for {n_objectives} direction(s)", metrics)
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        return _failed("config", f"the job returned {values!r}, not numbers", metrics)
    if not all(math.isfinite(v) for v in values):
        return _failed("nan", f"the metric is {values}", metrics)
    if metrics.get("stopped_early") and metrics.get("stop_reason") != "early_stopping":  # pruned
        return Outcome("PRUNED", None, None, None, metrics)  # optuna records the last reported value
    return Outcome("COMPLETE", values, None, None, metrics)


def _failed(kind: str, message: str, metrics: dict) -> Outcome:
    first = message.strip().splitlines()[0] if message.strip() else "no message"
    return Outcome("FAIL", None, f"{kind}: {first}"[:500], kind, metrics)
