"""The sweep directory's summary, rewritten after every trial from the study itself (so any worker can write
it, and it is right after a resume): optimization_results.yaml (hydra-optuna-sweeper's keys first: name,
best_params and best_value, or solutions for several objectives; then this project's), trials.csv, and
optuna's plots as HTML and PNG (these at the end, and at most once a minute during the sweep: they take a while;
never again from the same trials, which PLOTS_STAMP records: a finished study reopened does not redraw them).

Every file is replaced atomically: a reader (or a second worker writing too) never sees half a file; the
tables are written under a file lock, so that the last one written is from the newest reading of the study.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml
from optuna.trial import TrialState

from lychee_exp.config.choices import MIX
from lychee_exp.io.atomic import locked, write_bytes_atomic, write_text_atomic
from lychee_exp.ir.metrics import mix_figure, model_figure
from lychee_exp.sweep.storage import METRICS, REASON, RUN_DIR, SURPLUS, tally
from lychee_exp.tracking.keys import TRIALS_CSV_COLUMNS

log = logging.getLogger(__name__)
# the stamp of the trials the plots were drawn from: a reopened finished study does not redraw them
PLOTS_STAMP = ".plots.stamp"


def write_sweep_results(
    study: Any, sweep_dir: Path, n_trials: int, metric: str | Sequence[str], storage_url: str, plots: bool = True
) -> None:
    # the study is read under the lock: a worker that read it earlier cannot rename an older table over a newer one
    with locked(sweep_dir / "trials.csv"):
        trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(SURPLUS)]
        summary = _summary(study, trials, n_trials, metric, storage_url)
        write_text_atomic(sweep_dir / "optimization_results.yaml", summary)
        write_text_atomic(sweep_dir / "trials.csv", _table(trials))
    if not plots:
        return
    try:
        _write_plots(study, sweep_dir)
    except Exception as err:  # a plot must never end a sweep
        log.warning("could not write the plots: %s", str(err).splitlines()[0])


def _summary(study: Any, trials: list, n_trials: int, metric: Any, storage_url: str) -> str:
    counts = tally(study)
    summary: dict[str, Any] = {"name": "optuna"}  # hydra-optuna-sweeper's file: tools read this name
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if len(study.directions) == 1 and complete:
        best = study.best_trial
        summary.update(
            best_params=dict(best.params),
            best_value=best.value,
            best_trial=best.number,
            best_run_dir=best.user_attrs.get(RUN_DIR),
        )
    elif complete:  # the Pareto front
        summary["solutions"] = [
            {
                "params": dict(t.params),
                "values": list(t.values),
                "number": t.number,
                "run_dir": t.user_attrs.get(RUN_DIR),
            }
            for t in study.best_trials
        ]
    summary.update(
        sweeper="lychee_optuna",
        study_name=study.study_name,
        storage=storage_url,
        metric=metric,
        direction=[d.name.lower() for d in study.directions],
        n_trials=n_trials,
        finished=counts.finished,
        complete=counts.complete,
        pruned=counts.pruned,
        failed=counts.failed,
        interrupted=counts.interrupted,
        running=counts.running,
        queued=counts.waiting,
    )
    if study.user_attrs.get("placement"):  # hydra.sweeper.devices_per_trial's decision (and auto's figures)
        summary["placement"] = study.user_attrs["placement"]
    return yaml.safe_dump(summary, sort_keys=False)


def _table(trials: list) -> str:
    param_keys = sorted({key for t in trials for key in t.params})
    lr_key = next((k for k in param_keys if k.endswith(".lr") or k == "lr"), None)
    batch_key = next((k for k in param_keys if k.endswith("batch_size")), None)
    other = [k for k in param_keys if k not in (lr_key, batch_key)]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([*TRIALS_CSV_COLUMNS, *other])
    for t in trials:
        if t.state == TrialState.WAITING:
            continue
        m = t.user_attrs.get(METRICS) or {}
        duration = (
            (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and t.datetime_start else ""
        )
        value = t.values[0] if t.values else (t.value if t.state == TrialState.PRUNED and t.value is not None else "")
        row = {
            "number": t.number,
            "state": t.state.name,
            "lr": t.params.get(lr_key, m.get("base_lr", "")),
            "per_device_batch_size": m.get("per_device_batch_size", t.params.get(batch_key, "")),
            "effective_batch_size": m.get("effective_batch_size", ""),
            "metric": value,
            "model_ndcg@10": _blank(model_figure(m)),
            "mix_ndcg@10": _blank(mix_figure(m)),
            "mix": m.get(MIX, ""),
            "duration_s": f"{duration:.1f}" if duration != "" else "",
            "reason": t.user_attrs.get(REASON, ""),
            "run_dir": t.user_attrs.get(RUN_DIR, ""),
        }
        for key in ("steps", "train_time_s", "eval_time_s", "warm_ranks", "speedup", "scaling_efficiency"):
            row[key] = m.get(key, "")
        row["overhead_s"] = _overhead(duration, m)
        writer.writerow([*(row[c] for c in TRIALS_CSV_COLUMNS), *(t.params.get(k, "") for k in other)])
    return out.getvalue()


def _blank(value: float | None) -> float | str:
    return "" if value is None else value


def _overhead(duration: float | str, metrics: dict) -> str:
    """What the trial spent outside training and evaluation: starting ranks, loading, saving, the sweep's books."""
    if duration == "" or "train_time_s" not in metrics or "eval_time_s" not in metrics:
        return ""
    return f"{duration - metrics['train_time_s'] - metrics['eval_time_s']:.2f}"


def _write_plots(study: Any, sweep_dir: Path) -> None:
    """Each plot twice: interactive HTML (plotly) and a PNG (matplotlib) that docs and reports can embed."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return
    # multi-objective: plots follow the first objective
    target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
    name = "objective 0" if target else "value"
    plots = {"optimization_history": ("plot_optimization_history", {})}
    keys = sorted({key for t in complete for key in t.params})
    if len(complete) >= 2 and keys:
        plots["param_importances"] = ("plot_param_importances", {})
        plots["slice"] = ("plot_slice", {})
    lr_key = next((k for k in keys if k.endswith(".lr") or k == "lr"), None)
    batch_key = next((k for k in keys if k.endswith("batch_size")), None)
    pair = [lr_key, batch_key] if lr_key and batch_key else keys[:2]
    if len(complete) >= 2 and len(pair) == 2:
        plots["contour_lr_batch" if lr_key and batch_key else "contour"] = ("plot_contour", {"params": pair})
    stamp = _plots_stamp(study, complete, plots)
    drawn = [sweep_dir / f"{stem}.{kind}" for stem in plots for kind in ("html", "png")]
    if _read(sweep_dir / PLOTS_STAMP) == stamp and all(path.is_file() for path in drawn):
        return  # drawn from these very trials already (a finished study reopened): seconds saved, same files
    # imported here: plotly, pandas and scipy cost a second, which a sweep ended by a bad config never needs
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI backend in a worker thread
    import optuna.visualization as vis
    import optuna.visualization.matplotlib as vis_png

    with warnings.catch_warnings(), _quiet("matplotlib.category"):
        warnings.simplefilter("ignore")  # optuna's experimental-API warnings, once per trial, add nothing
        for stem, (function, extra) in plots.items():
            figure = getattr(vis, function)(study, target=target, target_name=name, **extra)
            html = figure.to_html(include_plotlyjs=True, full_html=True)  # self-contained: opens offline
            write_text_atomic(sweep_dir / f"{stem}.html", html)
            write_bytes_atomic(sweep_dir / f"{stem}.png", _png(getattr(vis_png, function), study, target, name, extra))
    write_text_atomic(sweep_dir / PLOTS_STAMP, stamp)


def _plots_stamp(study: Any, complete: list, plots: dict) -> str:
    """What the plots are drawn from: the directions, the complete trials' numbers, values and parameters, and
    which plots; equal stamps draw equal plots."""
    rows = [(t.number, t.values, sorted(t.params.items())) for t in complete]
    text = json.dumps([[d.name for d in study.directions], sorted(plots), rows], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """A logger's INFO records left out while optuna draws: matplotlib.category advises casting number-like strings
    to numbers (twice per plot with a categorical parameter, 4 lines after each sweep), but optuna plots a
    categorical parameter's choices (batch sizes 4, 8, 16) as category labels on purpose."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _png(plot, study: Any, target, name: str, extra: dict) -> bytes:
    import matplotlib.pyplot as plt
    import numpy as np

    axes = plot(study, target=target, target_name=name, **extra)
    figure = np.atleast_1d(axes).flat[0].figure
    if len(np.atleast_1d(axes)) > 1:  # one panel per parameter (slice): wide enough to read the axes
        figure.set_size_inches(4 * len(np.atleast_1d(axes)), 4)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
