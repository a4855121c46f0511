"""python -m lychee_exp.report <runs-or-sweep dir> [--out report.html] [--title TEXT] [--overwrite]

One self-contained HTML page comparing every run below a directory (every directory holding a metrics.json),
with the same comparisons as the W&B workspace (lychee_exp.tracking.wandb_workspace) for users without a W&B
account: a runs table (the model's own ndcg@10 and any mix's side by side), speedup and scaling efficiency vs world
size, the model's ndcg@10 against lr and effective batch size,
loss curves grouped by sweep, throughput and memory; plus each Optuna sweep's trials (trials.csv) and each scaling
benchmark (bench.csv) found there. Inline CSS and SVG only: it opens offline, from a mail attachment too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from lychee_exp.config.choices import MIX
from lychee_exp.errors import command_main
from lychee_exp.io.outputs import POLICY_LINE, interrupted_line
from lychee_exp.ir.metrics import mix_figure
from lychee_exp.tracking.keys import num_devices
from lychee_exp.tracking.report import plots
from lychee_exp.tracking.report.data import (
    Found,
    Run,
    Table,
    argmax,
    best_row,
    best_trial,
    config_value,
    find,
    fmt,
    number,
    report_root,
)
from lychee_exp.tracking.report.output import GENERATOR_TAG, page_output

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2433;margin:0;
background:#f6f7f9}
main{max-width:1240px;margin:0 auto;padding:20px 28px 48px}
h1{font-size:22px;margin:0 0 2px}
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d8dce3;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}.meta{color:#5b6475;margin:0 0 12px}.note{color:#5b6475;font-size:13px}
.card{background:#fff;border:1px solid #e1e4ea;border-radius:8px;padding:12px 14px;margin:10px 0;overflow-x:auto}
table{border-collapse:collapse;font-size:13px;width:100%}
th,td{padding:5px 7px;border-bottom:1px solid #eceef2;text-align:right;white-space:nowrap}
th{background:#f0f2f5;font-weight:600;white-space:normal;vertical-align:bottom}
th:first-child,td:first-child{text-align:left}
tr.best td{background:#eefaf0}.gain{color:#1a7f37;font-size:12px}.loss{color:#b42318;font-size:12px}
.fig svg{max-width:100%;height:auto}
nav a{margin-right:14px;color:#2f5fb3;text-decoration:none}
"""

# the runs table: what the W&B workspace compares runs by, one row per run
RUN_COLUMNS = [
    "run",
    "model / loss",
    "world size",
    "effective batch",
    "lr (base → scaled)",
    "model ndcg@10 (gain)",
    "model mrr@10",
    "mix ndcg@10",
    "mixed with",
    "speedup",
    "efficiency",
    "samples/s",
    "peak memory (MB)",
]
THROUGHPUT_COLUMNS = [
    "run",
    "samples/s",
    "tokens/s",
    "data wait",
    "rank spread",
    "peak memory per rank (MB)",
    "train time (s)",
    "eval time (s)",
    "steps",
    "precision",
    "device",
]


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    table_id: str = "",
    cls: str = "",
    highlight: int | None = None,
) -> str:
    """Cells arrive escaped (some carry markup such as the gain span)."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join(
        f"<tr{' class=best' if i == highlight else ''}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    attrs = (f' id="{table_id}"' if table_id else "") + (f' class="{cls}"' if cls else "")
    return f'<div class="card"><table{attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _figure(svg: str, empty: str) -> str:
    return f'<div class="card fig">{svg}</div>' if svg else f'<p class="note">{_esc(empty)}</p>'


def _ndcg_cell(run: Run) -> str:
    """The model's own ndcg@10 and its gain over the untrained model's."""
    ndcg, initial = run.model("ndcg@10"), run.model("ndcg@10", initial=True)
    if ndcg is None or initial is None:
        return _esc(fmt(ndcg, "f3"))
    gain = ndcg - initial
    return f'{fmt(ndcg, "f3")} <span class="{"gain" if gain >= 0 else "loss"}">({gain:+.3f})</span>'


def _run_row(run: Run) -> list[str]:
    m, c = run.metrics, run.config
    model = " / ".join(str(v) for v in (config_value(c, "model.name"), config_value(c, "loss.name")) if v)
    base, used = m.get("base_lr", config_value(c, "optimizer.lr")), m.get("lr")
    # the sweep searches the base lr; the run trains with it scaled to its effective batch
    lr = fmt(used if used is not None else base, "lr")
    if used is not None and base is not None and fmt(base, "lr") != lr:
        lr = f"{fmt(base, 'lr')} → {lr}"
    head = [
        run.name,
        fmt(model or None),
        fmt(num_devices(m), "int"),
        fmt(m.get("effective_batch_size"), "int"),
        lr,
    ]
    tail = [
        fmt(run.model("mrr@10"), "f3"),
        fmt(number(mix_figure(m)), "f3"),
        fmt(m.get(MIX) or None),
        fmt(m.get("speedup"), "f2"),
        fmt(m.get("scaling_efficiency"), "pct"),
        fmt(m.get("train_samples_per_s"), "f2"),
        fmt(run.peak_memory_mb, "int"),
    ]
    return [_esc(c) for c in head] + [_ndcg_cell(run)] + [_esc(c) for c in tail]


def _throughput_row(run: Run) -> list[str]:
    m = run.metrics
    per_rank = [fmt(v, "int") for v in m.get("peak_memory_mb_per_rank") or []]
    cells = [
        run.name,
        fmt(m.get("train_samples_per_s"), "f2"),
        fmt(m.get("train_tokens_per_s"), "int"),
        fmt(m.get("data_wait_share"), "pct"),
        fmt(m.get("rank_time_spread"), "f2"),
        ", ".join(per_rank) or fmt(None),
        fmt(m.get("train_time_s"), "f2"),
        fmt(m.get("eval_time_s"), "f2"),
        fmt(m.get("steps"), "int") + (" (stopped early)" if m.get("stopped_early") else ""),
        fmt(m.get("precision")),
        fmt(" · ".join(str(m[k]) for k in ("device_type", "strategy") if m.get(k)) or m.get("device")),
    ]
    return [_esc(c) for c in cells]


def _csv_table(table: Table, cls: str, highlight_best: bool = False) -> str:
    rows = [[_esc(fmt(row.get(col))) for col in table.columns] for row in table.rows]
    return _table(table.columns, rows, cls=cls, highlight=best_row(table.rows) if highlight_best else None)


def _sweep_section(sweep: Table) -> str:
    best, s = best_trial(sweep), sweep.summary
    parts = [f"<h3>Sweep {_esc(sweep.name)}</h3>"]
    facts = [
        f"{k}: {fmt(s[k])}"
        for k in ("study_name", "metric", "direction", "n_trials", "complete", "pruned", "failed")
        if k in s
    ]
    if facts:
        parts.append(f'<p class="meta">{_esc(" · ".join(facts))}</p>')
    if best:
        params = ", ".join(f"{k} = {fmt(v)}" for k, v in best["params"].items()) or fmt(None)
        parts.append(
            f'<p class="best-params"><b>Best trial {_esc(fmt(best["trial"]))}</b>: metric '
            f"{_esc(fmt(best['value']))} with {_esc(params)}</p>"
        )
    no_table = '<p class="note">no trials.csv</p>'
    parts.append(_csv_table(sweep, "sweep", highlight_best=True) if sweep.columns else no_table)
    return "".join(parts)


def _bench_section(table: Table) -> str:
    return (
        f"<h3>Scaling benchmark {_esc(table.name)}</h3>"
        + _csv_table(table, "bench")
        + _figure(plots.bench(table), "bench.csv has no devices/speedup columns to plot")
    )


def render(found: Found, root: Path, title: str | None = None) -> str:
    runs = found.runs
    title = title or f"lychee_exp report: {root.name}"
    best = argmax([r.model("ndcg@10") for r in runs])
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    curves = [
        f"<h3>{_esc(g)}</h3>" + _figure(plots.curves(rs), "no metrics.csv with train/loss in these runs")
        for g, rs in groups.items()
    ]
    sections = {
        "Runs": (
            _table(RUN_COLUMNS, (_run_row(r) for r in runs), "runs", highlight=best)
            + '<p class="note">model: the trained model\'s own dev figures (model_ndcg@10, what sweeps optimize); '
            "in brackets its gain over the untrained model. mix: the run's ranking when it mixes the model's scores "
            "with the teacher's or the first stage's (ndcg@10), named in the next column. "
            "Highlighted: the best model ndcg@10. Speedup = samples/s over one device's; efficiency = "
            "speedup / world size.</p>"
        )
        if runs
        else '<p class="note">no metrics.json found</p>',
        "Scaling": _figure(plots.scaling(runs), "no run recorded a speedup")
        + "".join(_bench_section(b) for b in found.benches),
        "Sweeps": "".join(_sweep_section(s) for s in found.sweeps) or '<p class="note">no trials.csv found</p>',
        "Hyperparameters": _figure(plots.hyperparameters(runs), "no run recorded the model's ndcg@10"),
        "Training": "".join(curves) or '<p class="note">no runs</p>',
        "Throughput & memory": _figure(plots.bars(runs), "no throughput or memory figures recorded")
        + (_table(THROUGHPUT_COLUMNS, (_throughput_row(r) for r in runs), "throughput") if runs else ""),
    }
    anchors = {name: name.lower().replace(" & ", "-").replace(" ", "-") for name in sections}
    nav = "".join(f'<a href="#{anchors[n]}">{_esc(n)}</a>' for n in sections)
    body = "".join(
        f'<section id="{anchors[n]}"><h2>{_esc(n)}</h2>{content}</section>' for n, content in sections.items()
    )
    stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    meta = (
        f"{len(runs)} runs, {len(found.sweeps)} sweeps, {len(found.benches)} benchmarks under "
        f"{root} · generated {stamp}"
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">{GENERATOR_TAG}<title>{_esc(title)}</title>'
        f"<style>{CSS}</style></head><body><main><h1>{_esc(title)}</h1><p class=meta>{_esc(meta)}</p>"
        f"<nav>{nav}</nav>{body}</main></body></html>"
    )


def build(root: Path | str, out: Path | str | None = None, title: str | None = None, overwrite: bool = False) -> Path:
    """Writes the page to out (default <root>/report.html), kept as the user spelled it: `dir/` or '' is refused
    in one line, not read as `dir` or as the default. A browser reloading the page, or a second report, never sees
    half a file; nothing the user has is replaced."""
    root = report_root(root)  # before --out is checked: its default lies inside root, which must not be created
    spec = page_spec(root, out)
    with page_output(spec, root, overwrite) as staged:
        staged.write_text(render(find(root), root.resolve(), title), encoding="utf-8")
    return Path(spec)


def headless_chromium(page: Path, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Loads a page in headless Chromium (tests dump its DOM; docs take a screenshot); a throwaway profile and
    no background traffic, so it runs offline and leaves nothing behind."""
    binary = shutil.which("chromium") or "/usr/bin/chromium"
    with tempfile.TemporaryDirectory(prefix="lychee-chromium-") as profile:
        cmd = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *flags,
            Path(page).resolve().as_uri(),
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lychee_exp.report", description=__doc__.split("\n\n")[1], epilog=POLICY_LINE
    )
    parser.add_argument("dir", help="a runs or sweep directory; every directory below it with a metrics.json is a run")
    parser.add_argument("--out", help="the HTML file to write (default: <dir>/report.html)")
    parser.add_argument("--title", help="the page title")
    parser.add_argument("--overwrite", action="store_true", help="replace an --out file that is not a report page")
    args = parser.parse_args(argv)

    def report() -> None:
        print(build(args.dir, args.out, args.title, args.overwrite))

    # a user mistake: one line, exit 2; Ctrl-C: one line, exit 130, --out as it was
    return command_main(report, lambda: interrupted_line(page_spec(args.dir, args.out)))


def page_spec(root: Path | str, out: Path | str | None) -> str:
    """--out as the user spelled it, or the default <root>/report.html."""
    return str(Path(root) / "report.html") if out is None else str(out)


if __name__ == "__main__":
    sys.exit(main())
