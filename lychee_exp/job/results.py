"""The end of a job in the Hydra process: metrics.json (complete or absent, never half-written) and the lines
that sum the run up."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from lychee_exp.core.atomic import write_json_atomic
from lychee_exp.core.config import RunConfig
from lychee_exp.core.devices import DevicePlan
from lychee_exp.launch.cluster import launched_externally
from lychee_exp.tracking.speedup import store_baseline

log = logging.getLogger("lychee_exp")


def write_results(run_cfg: RunConfig, plan: DevicePlan, metrics: dict, output_dir: Path, is_main: bool) -> float:
    """Writes metrics.json (main process) and returns the optimized metric (nan without an evaluation)."""
    metrics_path = output_dir / "metrics.json"
    metrics["optimized_metric"] = str(run_cfg.optimized_metric)
    if is_main and plan.num_devices == 1 and plan.strategy != "dp" and not launched_externally():
        store_baseline(run_cfg, plan, metrics["train_samples_per_s"], f"run {output_dir}")
    if is_main and not math.isfinite(metrics.get("speedup", 0.0)):
        metrics.pop("speedup", None)  # absent, not NaN: there was nothing to compare with
        log.info(
            "speedup: no single-process baseline for this setting (cached in %s, or speedup.baseline_samples_per_s)"
            "; metrics.json has no speedup",
            run_cfg.speedup.baseline_file,
        )
    if is_main and not math.isfinite(metrics.get("speedup_vs_one_rank", 0.0)):
        for key in ("speedup_vs_one_rank", "scaling_efficiency"):
            metrics.pop(key, None)
    if is_main:
        write_json_atomic(metrics_path, metrics)
        if "ndcg@10" in metrics:
            # the references this run measured: untrained (eval_before_training), BM25, the dev file's teacher
            names = {
                "model_ndcg@10": "model alone",  # data.teacher_weight > 0: ndcg@10 is of the mix with the teacher
                "initial_ndcg@10": "untrained",
                "bm25_ndcg@10": "BM25",
                "teacher_ndcg@10": "teacher",
            }
            refs = ", ".join(f"{name} {metrics[key]:.4f}" for key, name in names.items() if key in metrics)
            log.info("dev ndcg@10 %.4f (%s), mrr@10 %.4f", metrics["ndcg@10"], refs, metrics["mrr@10"])
        speedup_note = (
            f"; speedup {metrics['speedup']:.2f}x over {metrics['speedup_baseline']}" if "speedup" in metrics else ""
        )
        if "speedup_vs_one_rank" in metrics and metrics["num_devices"] > 1:
            speedup_note += (
                f" ({metrics['speedup_vs_one_rank']:.2f}x over {metrics['speedup_vs_one_rank_baseline']}, scaling "
                f"efficiency {100 * metrics['scaling_efficiency']:.0f}%)"
            )
        log.info(
            "%d steps in %.0f s: %.1f samples/s on %d device(s), effective batch %d%s",
            metrics["steps"],
            metrics["train_time_s"],
            metrics["train_samples_per_s"],
            metrics["num_devices"],
            metrics["effective_batch_size"],
            speedup_note,
        )
        log.info("results in %s", output_dir)

    return float(metrics.get(run_cfg.optimized_metric, float("nan")))  # nan: trainer.evaluate=false
