"""The end of a job in the Hydra process: metrics.json (complete or absent, never half-written) and the lines
that sum the run up."""

from __future__ import annotations

import logging
from pathlib import Path

from lychee_exp.config.schema import RunConfig
from lychee_exp.io.atomic import read_json, write_json_atomic
from lychee_exp.ir.first_stage import stage_name
from lychee_exp.ir.metrics import standing_below_first_stage
from lychee_exp.tracking.speedup import speedup_note

log = logging.getLogger("lychee_exp")


def write_results(run_cfg: RunConfig, metrics: dict, output_dir: Path, is_main: bool) -> float:
    """Writes metrics.json (main process) and returns the optimized metric (nan without an evaluation)."""
    metrics_path = output_dir / "metrics.json"
    metrics["optimized_metric"] = str(run_cfg.optimized_metric)
    if is_main:
        write_json_atomic(metrics_path, metrics)
        if "ndcg@10" in metrics:
            # the references this run measured: untrained (eval_before_training), BM25, the dev file's teacher
            names = {
                "model_ndcg@10": "model alone",  # a teacher or first-stage weight > 0: ndcg@10 is of the mix
                "initial_ndcg@10": "untrained",
                "bm25_ndcg@10": "BM25",
                "teacher_ndcg@10": "teacher",
            }
            refs = ", ".join(f"{name} {metrics[key]:.4f}" for key, name in names.items() if key in metrics)
            log.info("dev ndcg@10 %.4f (%s), mrr@10 %.4f", metrics["ndcg@10"], refs, metrics["mrr@10"])
            below = standing_below_first_stage(metrics, stage_name(run_cfg.data.first_stage))
            if below:
                log.warning("%s", below)
        log.info(
            "%d steps in %.0f s: %.1f samples/s on %d device(s), effective batch %d%s",
            metrics["steps"],
            metrics["train_time_s"],
            metrics["train_samples_per_s"],
            metrics["num_devices"],
            metrics["effective_batch_size"],
            speedup_note(metrics),
        )
        if "optimizer_bytes_per_rank" in metrics:  # what each device holds besides activations (fsdp: shards)
            mib = {key: max(metrics[f"{key}_bytes_per_rank"]) / 2**20 for key in ("param", "grad", "optimizer")}
            log.info(
                "state per device: parameters %(param).1f MiB, gradients %(grad).1f MiB, optimizer %(optimizer).1f MiB",
                mib,
            )
        log.info("results in %s", output_dir)

    return float(metrics.get(run_cfg.optimized_metric, float("nan")))  # nan: trainer.evaluate=false


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
    return float(earlier.get(run_cfg.optimized_metric, float("nan")))
