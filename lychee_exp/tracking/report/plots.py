"""The local report's figures: matplotlib (Agg, no display needed) rendered to inline SVG, so the page needs no
network and no files beside it. Each function returns an <svg> string, or "" when there is nothing to plot."""

from __future__ import annotations

import io
import itertools
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullLocator

from lychee_exp.tracking.keys import HISTORY, num_devices
from lychee_exp.tracking.report.data import Run, Table, number

_salt = itertools.count()
COLORS = plt.get_cmap("tab10").colors


def _svg(fig) -> str:
    # matplotlib names clip paths and markers by content hash: salting each figure keeps ids unique when
    # several SVGs share one HTML document
    with plt.rc_context({"svg.hashsalt": f"lychee{next(_salt)}", "svg.fonttype": "none"}):
        buf = io.StringIO()
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _figure(ncols: int = 1, width: float = 5.2, height: float = 3.4, **kwargs):
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False, **kwargs)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    return fig, list(axes[0])


def group_colors(runs: Sequence[Run]) -> dict[str, tuple]:
    groups = list(dict.fromkeys(run.group for run in runs))
    return {g: COLORS[i % len(COLORS)] for i, g in enumerate(groups)}


def _scatter_by_group(ax, runs: Sequence[Run], x: Callable[[Run], float | None], y: Callable[[Run], float | None]):
    """One colour per group (sweep), so trials of one sweep read as one series."""
    colors = group_colors(runs)
    plotted = False
    for group, color in colors.items():
        pts = [(x(r), y(r)) for r in runs if r.group == group]
        pts = [(a, b) for a, b in pts if a is not None and b is not None]
        if pts:
            ax.scatter(*zip(*pts), color=color, label=group, s=36, alpha=0.85, edgecolor="white", linewidth=0.5)
            plotted = True
    if plotted and len(colors) > 1:
        ax.legend(fontsize=8, frameon=False)
    return plotted


def _ticks_at_values(ax, runs: Sequence[Run], x: Callable[[Run], float | None], base: float, label: str) -> None:
    """Log axis ticked at the values the runs used (a sweep's grid), not at powers of ten."""
    values = sorted({v for r in runs if (v := x(r)) is not None and v > 0})
    if not values:
        return
    ax.set_xscale("log", base=base)
    ax.set_xticks(values)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format(v, label)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.tick_params(axis="x", labelrotation=30 if len(values) > 4 else 0)


def scaling(runs: Sequence[Run]) -> str:
    """Observed speedup and scaling efficiency against world size, with the ideal (linear) line."""
    if not any(r.get("speedup") is not None and num_devices(r.metrics) is not None for r in runs):
        return ""
    fig, (ax1, ax2) = _figure(2)
    _scatter_by_group(ax1, runs, lambda r: num_devices(r.metrics), lambda r: r.get("speedup"))
    top = max(num_devices(r.metrics) or 1 for r in runs)
    ax1.plot([1, top], [1, top], "--", color="grey", lw=1, label="ideal (linear)")
    ax1.legend(fontsize=8, frameon=False)
    ax1.set(xlabel="world size (devices)", ylabel="speedup over one device", title="Speedup")
    _scatter_by_group(ax2, runs, lambda r: num_devices(r.metrics), lambda r: r.get("scaling_efficiency"))
    ax2.axhline(1.0, ls="--", color="grey", lw=1)
    ax2.set(xlabel="world size (devices)", ylabel="speedup / world size", title="Scaling efficiency", ylim=(0, 1.1))
    return _svg(fig)


def bench(table: Table) -> str:
    """The benchmark's speedup per device count, next to the ideal line."""
    pts = sorted((number(r.get("devices")), number(r.get("speedup"))) for r in table.rows)
    pts = [(d, s) for d, s in pts if d is not None and s is not None]
    if not pts:
        return ""
    fig, (ax1, ax2) = _figure(2)
    devices, speedup = zip(*pts)
    ax1.plot(devices, devices, "--", color="grey", lw=1, label="ideal (linear)")
    ax1.plot(devices, speedup, "o-", color=COLORS[0], label="measured")
    for d, s in pts:
        ax1.annotate(f"{s:.2f}×", (d, s), textcoords="offset points", xytext=(8, -12), fontsize=8)
    ax1.set(xlabel="devices", ylabel="speedup over 1 device", title="Speedup", ylim=(0, None))
    ax1.legend(fontsize=8, frameon=False)
    ax2.bar([str(int(d)) for d in devices], [s / d for d, s in pts], color=COLORS[0], width=0.55)
    ax2.axhline(1.0, ls="--", color="grey", lw=1)
    ax2.set(xlabel="devices", ylabel="speedup / devices", title="Scaling efficiency", ylim=(0, 1.1))
    ax1.set_xticks(devices)
    return _svg(fig)


def hyperparameters(runs: Sequence[Run]) -> str:
    """The model's own ndcg@10 against the learning rate (log axis) and against the effective batch size."""
    if not any(r.model("ndcg@10") is not None for r in runs):
        return ""
    fig, (ax1, ax2) = _figure(2)

    def lr(r: Run) -> float | None:  # the swept value: the lr at the base batch, before scaling
        return r.get("base_lr") if r.get("base_lr") is not None else r.get("lr")

    def batch(r: Run) -> float | None:
        return r.get("effective_batch_size")

    def ndcg(r: Run) -> float | None:
        return r.model("ndcg@10")

    if _scatter_by_group(ax1, runs, lr, ndcg):
        _ticks_at_values(ax1, runs, lr, 10, ".0e")
    ylabel = "the model's dev ndcg@10"
    ax1.set(xlabel="learning rate (at base batch)", ylabel=ylabel, title="model ndcg@10 vs learning rate")
    if _scatter_by_group(ax2, runs, batch, ndcg):
        _ticks_at_values(ax2, runs, batch, 2, ".0f")
    ax2.set(xlabel="effective batch size (queries / step)", ylabel=ylabel, title="model ndcg@10 vs batch size")
    return _svg(fig)


def curves(runs: Sequence[Run]) -> str:
    """Training loss and the model's dev ndcg@10 over steps for one group of runs (a sweep's trials side by side;
    runs that logged no dev/model_ndcg@10, written before every run did, ranked by the model alone: dev/ndcg@10)."""
    fig, (ax1, ax2) = _figure(2)
    drawn = False
    for i, run in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        label = run.name.rsplit("/", 1)[-1]
        logged_own = any(HISTORY["dev_model_ndcg"] in row for row in run.history)
        own = HISTORY["dev_model_ndcg"] if logged_own else HISTORY["dev_ndcg"]
        for ax, key in ((ax1, HISTORY["loss"]), (ax2, own)):
            pts = [(row["step"], row[key]) for row in run.history if key in row]
            if pts:
                ax.plot(
                    *zip(*pts), color=color, label=label, lw=1.4, marker="o" if key.startswith("dev") else None, ms=3
                )
                drawn = True
    if not drawn:
        plt.close(fig)
        return ""
    ax1.set(xlabel="step", ylabel="train/loss", title="Training loss")
    ax2.set(xlabel="step", ylabel="dev/model_ndcg@10", title="The model's dev ndcg@10")
    if len(runs) > 1:
        ax1.legend(fontsize=7, frameon=False, ncol=2)
    return _svg(fig)


def bars(runs: Sequence[Run]) -> str:
    """Throughput (samples/s) and peak memory of the busiest rank, one bar per run."""
    rows = [(r.name, r.get("train_samples_per_s"), r.peak_memory_mb) for r in runs]
    if not any(v is not None for _, a, b in rows for v in (a, b)):
        return ""
    fig, (ax1, ax2) = _figure(2, height=max(2.4, 0.32 * len(rows) + 1.2), sharey=True)
    colors = group_colors(runs)
    names = [name for name, _, _ in rows][::-1]
    palette = [colors[r.group] for r in runs][::-1]
    for ax, values, title in (
        (ax1, [a for _, a, _ in rows], "train samples/s"),
        (ax2, [b for _, _, b in rows], "peak memory, max over ranks (MB)"),
    ):
        values = [v or 0.0 for v in values][::-1]
        ax.barh(names, values, color=palette)
        ax.set(title=title)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(True, axis="x", alpha=0.3)
        ax.grid(False, axis="y")
    return _svg(fig)
