"""python -m lychee_exp.dashboard --entity E --project P [--name NAME] (--save | --dry-run out.json [--overwrite])

A W&B workspace for a lychee_exp project, with the panels runs are compared by — the same comparisons as the
local report (lychee_exp.tracking.report.html):

- Scaling: observed speedup and scaling efficiency against the number of devices, and throughput per number of devices
  (scatter plots of summary values, one point per run).
- Hyperparameters: the model's own dev ndcg@10 (model_ndcg@10, what sweeps optimize) against the learning rate and
  the effective batch size (parallel coordinates over the config, with the mix beside it; scatter plots) and a run
  comparer for the config differences.
- Training: train/loss and the model's dev/model_ndcg@10 over steps, one curve per run group (a sweep's trials share
  a group) with its min-max band, and per run: the model alone, and the run's ranking (dev/ndcg@10: the mix that the
  run's `mix` names, or the model again).
- Throughput & memory: samples/s, tokens/s, data-wait share over steps; peak memory per run.

--dry-run builds the definition offline and writes its JSON (what --save would upload), whole, over an earlier
definition only (another file with --overwrite; never over an input, a run, a model or a dataset: docs/outputs.md);
--save needs a W&B API key (WANDB_API_KEY or `wandb login`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from lychee_exp.errors import INTERRUPTED, UserError, command_main
from lychee_exp.io.outputs import POLICY_LINE, interrupted_line, staged_output
from lychee_exp.tracking.backends import has_wandb_api_key
from lychee_exp.tracking.keys import HISTORY

DEFAULT_NAME = "lychee_exp: scaling, hyperparameters, training"
DEFINITION_KEYS = {"entity", "project", "displayName", "spec"}  # what every --dry-run file holds (definition())


def _scatter(x, y, title: str, **kwargs) -> wr.ScatterPlot:
    return wr.ScatterPlot(title=title, x=x, y=y, **kwargs)


def workspace(entity: str, project: str, name: str = DEFAULT_NAME) -> ws.Workspace:
    """The workspace definition; builds offline (nothing is sent until .save())."""
    s, c = wr.SummaryMetric, wr.Config
    world = s("num_devices")

    def by_group(metric: str, title: str):
        # one mean curve per run group with its min-max band: a sweep's trials side by side with other sweeps
        return wr.LinePlot(
            title=title, x="Step", y=[metric], groupby="Group", groupby_aggfunc="mean", groupby_rangefunc="minmax"
        )

    def per_run(metrics: list[str], title: str):
        return wr.LinePlot(title=title, x="Step", y=metrics)

    sections = [
        ws.Section(
            name="Scaling",
            is_open=True,
            panels=[
                _scatter(world, s("speedup"), "speedup over one device vs devices"),
                _scatter(
                    world,
                    s("scaling_efficiency"),
                    "scaling efficiency (speedup / devices) vs devices",
                    range_y=(0, 1.1),
                ),
                _scatter(world, s(HISTORY["samples_per_s"]), "train samples/s vs devices"),
                _scatter(world, s("baseline_samples_per_s"), "one-device baseline samples/s"),
            ],
        ),
        ws.Section(
            name="Hyperparameters",
            is_open=True,
            panels=[
                wr.ParallelCoordinatesPlot(
                    title="lr / batch -> the model's dev ndcg@10 (best)",
                    columns=[
                        wr.ParallelCoordinatesPlotColumn(metric=c("optimizer.lr"), display_name="lr (base)", log=True),
                        wr.ParallelCoordinatesPlotColumn(metric=c("lr"), display_name="lr (scaled)", log=True),
                        wr.ParallelCoordinatesPlotColumn(metric=c("data.batch_size"), display_name="per-device batch"),
                        wr.ParallelCoordinatesPlotColumn(metric=c("num_devices"), display_name="devices"),
                        wr.ParallelCoordinatesPlotColumn(
                            metric=c("effective_batch_size"), display_name="effective batch"
                        ),
                        wr.ParallelCoordinatesPlotColumn(
                            metric=s(HISTORY["dev_model_ndcg"]), display_name="model ndcg@10"
                        ),
                        wr.ParallelCoordinatesPlotColumn(metric=s(HISTORY["dev_ndcg"]), display_name="ranking (mix)"),
                    ],
                    layout=wr.Layout(w=24, h=8),
                ),
                _scatter(c("optimizer.lr"), s("model_ndcg@10"), "model ndcg@10 vs lr", log_x=True),
                _scatter(
                    c("effective_batch_size"), s("model_ndcg@10"), "model ndcg@10 vs effective batch size", log_x=True
                ),
                wr.RunComparer(diff_only="split"),
            ],
        ),
        ws.Section(
            name="Training",
            is_open=True,
            panels=[
                by_group(HISTORY["loss"], "train/loss by group (sweep)"),
                by_group(HISTORY["dev_model_ndcg"], "the model's dev/model_ndcg@10 by group (sweep)"),
                per_run([HISTORY["loss"]], "train/loss per run"),
                per_run([HISTORY["dev_model_ndcg"], HISTORY["dev_model_mrr"]], "the model alone: ndcg@10 / mrr@10"),
                per_run([HISTORY["dev_ndcg"], HISTORY["dev_mrr"]], "the run's ranking (the mix, if any)"),
                per_run([HISTORY["lr"]], "learning rate"),
                per_run([HISTORY["grad_norm"]], "gradient norm"),
            ],
        ),
        ws.Section(
            name="Throughput & memory",
            is_open=True,
            panels=[
                per_run([HISTORY["samples_per_s"]], "train samples/s"),
                per_run([HISTORY["tokens_per_s"]], "train tokens/s"),
                per_run([HISTORY["data_wait"]], "data-wait share of step time"),
                # a token budget (data.max_tokens_per_batch) makes both vary from step to step
                per_run([HISTORY["queries_per_step"]], "queries per optimizer step"),
                per_run([HISTORY["tokens_per_step"]], "real tokens per optimizer step"),
                wr.BarPlot(title="peak memory, busiest rank (MB)", metrics=[s("peak_memory_mb")]),
                _scatter(world, s("peak_memory_mb"), "peak memory (MB) vs devices"),
            ],
        ),
    ]
    columns = [
        f"summary:{key}"
        for key in (
            "num_devices",
            "effective_batch_size",
            "model_ndcg@10",
            "model_mrr@10",
            "mix",
            "ndcg@10",
            "speedup",
            "scaling_efficiency",
            "peak_memory_mb",
        )
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        runset_settings=ws.RunsetSettings(pinned_columns=columns),
    )


def definition(space: ws.Workspace) -> dict:
    """The JSON W&B stores for the workspace (the view spec .save() uploads)."""
    return space._to_model().model_dump(by_alias=True, mode="json")  # the library's own serialisation for save()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lychee_exp.dashboard", description=__doc__.split("\n\n")[1], epilog=POLICY_LINE
    )
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", required=True, help="W&B project the runs were logged to (logger.project)")
    parser.add_argument("--name", default=DEFAULT_NAME, help="the workspace's name")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", action="store_true", help="create the workspace in W&B (needs an API key)")
    mode.add_argument("--dry-run", metavar="OUT.json", help="write the definition as JSON; no network")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a --dry-run file that is not an earlier definition"
    )
    args = parser.parse_args(argv)

    def dashboard() -> None:
        space = workspace(args.entity, args.project, args.name)
        if args.dry_run is None:
            _save(space)
            return
        with staged_output(
            args.dry_run,
            directory=False,
            overwrite=args.overwrite,
            inputs=(),
            key="--dry-run",
            ours=earlier_definition,
            overwrite_flag="--overwrite",
        ) as staged:
            staged.write_text(json.dumps(definition(space), indent=1))
        print(args.dry_run)

    # a user mistake: one line, exit 2; Ctrl-C: one line, exit 130, the --dry-run file as it was
    return command_main(dashboard, lambda: INTERRUPTED if args.dry_run is None else interrupted_line(args.dry_run))


def earlier_definition(path: Path) -> bool:
    """Whether path holds a workspace definition as --dry-run writes it (replaced by a re-run without
    --overwrite): a JSON object with a W&B view's keys, whose spec has sections."""
    try:
        found = json.loads(path.read_text()) if path.stat().st_size < 2**24 else None
    except (OSError, ValueError):
        return False
    return (
        isinstance(found, dict)
        and found.keys() >= DEFINITION_KEYS
        and isinstance(found["spec"], dict)
        and "section" in found["spec"]
    )


def _save(space: ws.Workspace) -> None:
    if not has_wandb_api_key():
        raise UserError("no W&B API key: set WANDB_API_KEY or run `wandb login` (or use --dry-run out.json)")
    try:
        space.save()
    except Exception as err:  # network, permissions, unknown entity: one line, not the client's traceback
        reason = str(err).strip().splitlines()[0] if str(err) else repr(err)
        raise UserError(f"could not save the workspace: {reason}") from None
    print(space.url)


if __name__ == "__main__":
    sys.exit(main())
