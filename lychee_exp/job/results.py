"""The end of a job in the Hydra process: metrics.json (complete or absent, never half-written) and the lines
that sum the run up."""

from __future__ import annotations

import logging
from pathlib import Path

from lychee_exp.config.choices import MIX, MODEL_PREFIX
from lychee_exp.config.schema import RunConfig
from lychee_exp.io.atomic import read_json, write_json_atomic
from lychee_exp.ir.first_stage import stage_name
from lychee_exp.ir.metrics import named_figure, standing_below_first_stage
from lychee_exp.tracking.phases import summary_line as phases_line
from lychee_exp.tracking.speedup import speedup_note

log = logging.getLogger("lychee_exp")


def write_results(run_cfg: RunConfig, metrics: dict, output_dir: Path, is_main: bool) -> float:
    """Writes metrics.json (main process) and returns the optimized metric (nan without an evaluation)."""
    metrics_path = output_dir / "metrics.json"
    metrics["optimized_metric"] = str(run_cfg.optimized_metric)
    if is_main:
        write_json_atomic(metrics_path, metrics)
        if "ndcg@10" in metrics:
            stage = stage_name(run_cfg.data.first_stage)
            log.info("%s", summary_line(metrics, stage))
            below = standing_below_first_stage(metrics, stage)
            if below:
                log.warning("%s", below)
        if metrics.get("steps_this_run") == 0:  # no throughput to tell
            log.info("resumed at its last step, %d: nothing trained again, the final evaluation ran", metrics["steps"])
        else:
            log.info(
                "%d steps in %.0f s: %.1f samples/s on %d device(s), effective batch %d%s",
                metrics["steps"],
                metrics["train_time_s"],
                metrics["train_samples_per_s"],
                metrics["num_devices"],
                metrics["effective_batch_size"],
                speedup_note(metrics),
            )
        memory = phases_line(metrics)
        if memory:
            log.info("%s", memory)
        if "optimizer_bytes_per_rank" in metrics:  # what each device holds besides activations (fsdp: shards)
            mib = {key: max(metrics[f"{key}_bytes_per_rank"]) / 2**20 for key in ("param", "grad", "optimizer")}
            log.info(
                "state per device: parameters %(param).1f MiB, gradients %(grad).1f MiB, optimizer %(optimizer).1f MiB",
                mib,
            )
        log.info("results in %s", output_dir)

    return _objective(metrics, str(run_cfg.optimized_metric))


def _objective(metrics: dict, name: str) -> float:
    """The optimized metric's value for a sweeper (nan without an evaluation: trainer.evaluate=false)."""
    value = named_figure(metrics, name)
    return float("nan") if value is None else value


def summary_line(metrics: dict, first_stage: str) -> str:
    """The run's dev figures, the model's own first, then any mix named with its weights, then the references this
    run measured (untrained: eval_before_training; BM25 and the teacher: the dev file's or split's), e.g.
    `dev ndcg@10: model 0.6308 (untrained 0.4310); mixed with the teacher at 0.7: 0.6731 (untrained 0.6458); BM25
    0.5551; teacher 0.6678. mrr@10: model 0.5561, mix 0.5878`."""

    def figure(name: str, key: str) -> str:
        initial = metrics.get(f"initial_{key}")
        return f"{name}{metrics[key]:.4f}" + (f" (untrained {initial:.4f})" if initial is not None else "")

    parts = [figure("model ", MODEL_PREFIX + "ndcg@10")]
    mix = metrics.get(MIX)
    if mix:
        parts.append(figure(f"mixed with {mix}: ", "ndcg@10"))
    stages = dict.fromkeys(("bm25", first_stage))  # the first stage by its own name when not BM25 (dense, run)
    references = {**{s: "BM25" if s == "bm25" else f"first stage ({s})" for s in stages}, "teacher": "teacher"}
    measured = {name: metrics.get(f"{key}_ndcg@10") for key, name in references.items()}
    parts += [f"{name} {value:.4f}" for name, value in measured.items() if value is not None]
    mrr = f"model {metrics[MODEL_PREFIX + 'mrr@10']:.4f}" + (f", mix {metrics['mrr@10']:.4f}" if mix else "")
    return f"dev ndcg@10: {'; '.join(parts)}. mrr@10: {mrr}"


def nothing_left(run_cfg: RunConfig, output_dir: Path, step: int, is_main: bool) -> float:
    """A finished run continued with nothing left to train: one line, its results as they were, and their
    optimized metric for a sweeper."""
    earlier = read_json(output_dir / "metrics.json")
    if is_main:
        log.info(
            "nothing left to train: %s had finished at step %d, which this configuration trains to; metrics.json "
            "and model/ are as they were (raise trainer.max_steps or trainer.max_epochs to train further)",
            output_dir,
            step,
        )
    return _objective(earlier, str(run_cfg.optimized_metric))
