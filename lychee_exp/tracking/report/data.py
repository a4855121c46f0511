"""What the local report reads: runs (every directory with a metrics.json), Optuna sweep summaries (trials.csv,
optimization_results.yaml) and scaling benchmarks (bench.csv), all found recursively under one directory.

Every input is optional past metrics.json and may come from an older lychee_exp, so a missing key or file is a
missing value (shown as "—"), never an error; a file that cannot be parsed is skipped with a warning.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lychee_exp.errors import UserError
from lychee_exp.ir.metrics import model_figure

log = logging.getLogger(__name__)

MISSING = "—"


@dataclass
class Run:
    name: str  # path relative to the report's root: unique, and says which sweep a trial belongs to
    group: str  # the parent directory (a sweep, or the runs folder): loss curves are grouped by it
    metrics: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)  # metrics.csv rows, blanks dropped
    config: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> float | None:
        """A numeric metric, or None when absent or not a number (older runs lack keys)."""
        return number(self.metrics.get(key))

    def model(self, name: str, initial: bool = False) -> float | None:
        """The model's own figure (initial: the untrained model's), whichever lychee_exp wrote the run."""
        metrics = self.metrics
        if initial:
            metrics = {k.removeprefix("initial_"): v for k, v in metrics.items() if k.startswith("initial_")}
        return number(model_figure(metrics, name))

    @property
    def peak_memory_mb(self) -> float | None:
        # the busiest rank is what runs out of memory
        per_rank = [number(v) for v in self.metrics.get("peak_memory_mb_per_rank") or []]
        per_rank = [v for v in per_rank if v is not None]
        return max(per_rank) if per_rank else self.get("peak_memory_mb")


@dataclass
class Table:
    """A CSV as read: its own header (sweeps and benchmarks add columns over time) and rows."""

    name: str  # directory relative to the root
    columns: list[str]
    rows: list[dict[str, str]]
    summary: dict[str, Any] = field(default_factory=dict)  # optimization_results.yaml, for sweeps


@dataclass
class Found:
    runs: list[Run]
    sweeps: list[Table]
    benches: list[Table]


def number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None or value == "":
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def natural_key(text: str) -> list:
    """trial 10 after trial 9, not after trial 1"""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def relative(path: Path, root: Path) -> str:
    rel = path.relative_to(root).as_posix()
    return root.name if rel == "." else rel


def report_root(root: Path | str) -> Path:
    """The directory the report reads, or one line saying there is none."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root}: no such directory")
    return root


def find(root: Path) -> Found:
    """Everything under root; UserError when root is missing or holds no run."""
    root = report_root(root).resolve()
    runs = [
        run
        for path in sorted(root.rglob("metrics.json"), key=lambda p: natural_key(str(p)))
        if (run := _read_run(path.parent, root)) is not None
    ]
    sweeps = [_read_sweep(path.parent, root) for path in _files(root, "trials.csv", "optimization_results.yaml")]
    benches = [t for path in _files(root, "bench.csv") if (t := _read_csv(path, relative(path.parent, root)))]
    if not runs and not any(sweeps) and not benches:
        raise UserError(f"{root}: no runs found (no metrics.json, trials.csv or bench.csv below it)")
    return Found(runs, [s for s in sweeps if s], benches)


def _files(root: Path, *names: str) -> list[Path]:
    """One path per directory holding any of names (a sweep dir has both of its files)."""
    dirs = {p.parent for name in names for p in root.rglob(name)}
    return [next(d / n for n in names if (d / n).is_file()) for d in sorted(dirs, key=lambda d: natural_key(str(d)))]


def _read_run(run_dir: Path, root: Path) -> Run | None:
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError) as err:
        log.warning("skipping %s: %s", run_dir / "metrics.json", err)
        return None
    if not isinstance(metrics, dict):
        log.warning("skipping %s: not a JSON object", run_dir / "metrics.json")
        return None
    name = relative(run_dir, root)
    group = relative(run_dir.parent, root) if run_dir != root else name
    return Run(name, group, metrics, _read_history(run_dir / "metrics.csv"), _read_yaml(run_dir / "config.yaml"))


def _read_history(path: Path) -> list[dict[str, float]]:
    table = _read_csv(path, "")
    if table is None:
        return []
    rows = [{k: v for k, v in ((k, number(v)) for k, v in row.items()) if v is not None} for row in table.rows]
    return [row for row in rows if "step" in row]


def _read_csv(path: Path, name: str) -> Table | None:
    if not path.is_file():
        return None
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            rows = [{k: (v or "") for k, v in row.items() if k is not None} for row in reader]
            return Table(name, list(reader.fieldnames or []), rows)
    except (OSError, csv.Error, UnicodeDecodeError) as err:
        log.warning("skipping %s: %s", path, err)
        return None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        log.warning("skipping %s: %s", path, str(err).splitlines()[0])
        return {}
    return data if isinstance(data, dict) else {}


def _read_sweep(sweep_dir: Path, root: Path) -> Table:
    name = relative(sweep_dir, root)
    table = _read_csv(sweep_dir / "trials.csv", name) or Table(name, [], [])
    table.summary = _read_yaml(sweep_dir / "optimization_results.yaml")
    return table


def best_trial(sweep: Table) -> dict[str, Any]:
    """The sweep's best: optimization_results.yaml's when written, else the highest-metric complete trial
    (lychee_exp's sweeps maximise ndcg@10 / mrr@10)."""
    s = sweep.summary
    if "best_params" in s:
        return {"trial": s.get("best_trial"), "value": s.get("best_value"), "params": s.get("best_params") or {}}
    if s.get("best_trials"):  # multi-objective: the Pareto front; show its first member
        first = s["best_trials"][0]
        return {"trial": first.get("number"), "value": first.get("values"), "params": first.get("params") or {}}
    best = best_row(sweep.rows)
    if best is None:
        return {}
    row = sweep.rows[best]
    params = {k: row[k] for k in ("lr", "per_device_batch_size", "effective_batch_size") if row.get(k)}
    return {"trial": row.get("number"), "value": number(row["metric"]), "params": params}


def argmax(values: list[float | None]) -> int | None:
    """Index of the highest value, None when there is none (missing values never win)."""
    scored = [(v, i) for i, v in enumerate(values) if v is not None]
    return max(scored)[1] if scored else None


def best_row(rows: list[dict[str, str]]) -> int | None:
    """The complete trial with the highest metric in a trials.csv."""
    return argmax([number(r.get("metric")) if r.get("state", "COMPLETE") == "COMPLETE" else None for r in rows])


def config_value(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def fmt(value: Any, kind: str = "g") -> str:
    """A cell: numbers rounded for reading, lists joined, anything missing as an em dash."""
    if value is None or value == "" or value == []:
        return MISSING
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v, kind) for v in value)
    num = number(value)
    if num is None:
        return str(value)
    if kind == "pct":
        return f"{num:.0%}"
    if kind == "int":
        return f"{num:,.0f}"
    if kind == "lr":
        return f"{num:.2e}"
    if kind == "f3":
        return f"{num:.3f}"
    if kind == "f2":
        return f"{num:.2f}"
    return f"{num:.4g}"
