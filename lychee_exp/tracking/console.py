"""The run's own log lines (setup, training steps, evaluations) on the main rank, and the matching logger rows."""

from __future__ import annotations

import logging

from lychee_exp.config.schema import RunConfig
from lychee_exp.tracking.backends import NullLogger
from lychee_exp.tracking.keys import DEV_PREFIX, HISTORY

log = logging.getLogger(__name__)


def log_setup(
    cfg: RunConfig,
    facts: dict,
    train_queries: int,
    dev_pairs,
    total_steps: int,
    steps_per_epoch: int,
    warmup_steps: int,
) -> None:
    """What the run is about to do, on the main rank: model, data, devices, batch and schedule."""
    log.info(
        "model %s (%s): %.1fM parameters, %.2fM trainable",
        cfg.model.name,
        cfg.model.kind,
        facts["parameters"] / 1e6,
        facts["trainable_parameters"] / 1e6,
    )
    log.info(
        "data: %d train queries, %d dev queries (%d pairs); device %s x %d, precision %s",
        train_queries,
        len(set(dev_pairs.query_index)),
        len(dev_pairs.labels),
        facts["device"],
        facts["num_devices"],
        facts["precision"],
    )
    budget = cfg.data.max_tokens_per_batch
    per_device = f"{budget} tokens" if budget else f"{cfg.data.batch_size} queries"
    log.info(
        "effective batch %s queries (%s per device x %d devices x %d accumulation); lr %.3g (base %.3g at "
        "batch %d, scaling %s); %d steps (%d per epoch), warmup %d",
        f"{facts['effective_batch_size']:.1f} (mean)" if budget else facts["effective_batch_size"],
        per_device,
        facts["num_devices"],
        cfg.trainer.grad_accum_steps,
        facts["lr"],
        cfg.optimizer.lr,
        cfg.optimizer.base_batch_size,
        cfg.optimizer.lr_scaling,
        total_steps,
        steps_per_epoch,
        warmup_steps,
    )


def log_train_step(
    logger: NullLogger,
    is_main: bool,
    step: int,
    total_steps: int,
    epoch: int,
    loss: float,
    lr: float,
    figures,
    gpu: dict | None = None,
    eta: str = "",
) -> None:
    """One training row: `loss` (the mean since the last row) and the logged step's own figures (a
    train.progress.StepFigures: grad_norm, queries and non-pad tokens over all ranks, seconds, data wait), plus
    rank 0's GPU memory and utilisation (`gpu`: throughput.gpu_memory's figures, {} off CUDA) and, in the console
    line only, `eta` (io.progress.row_eta: ' | 01:55 left' where stderr is not a terminal, else '')."""
    gpu = gpu or {}
    grad_norm, queries, tokens, elapsed, wait = (
        figures.grad_norm,
        figures.queries,
        figures.tokens,
        figures.seconds,
        figures.wait,
    )
    samples_per_s, tokens_per_s = queries / elapsed, tokens / elapsed
    logger.log_metrics(
        {
            HISTORY["loss"]: loss,
            HISTORY["lr"]: lr,
            HISTORY["grad_norm"]: grad_norm,
            HISTORY["samples_per_s"]: samples_per_s,
            HISTORY["tokens_per_s"]: tokens_per_s,
            HISTORY["data_wait"]: wait / elapsed,
            HISTORY["queries_per_step"]: queries,
            HISTORY["tokens_per_step"]: tokens,
            HISTORY["epoch"]: epoch,
            **gpu,
        },
        step,
    )
    if is_main:
        log.info(
            "step %d/%d | loss %.4f | lr %.3g | %.1f samples/s | %.0f tokens/s | %d queries %d tokens | "
            "data wait %.0f%%%s%s",
            step,
            total_steps,
            loss,
            lr,
            samples_per_s,
            tokens_per_s,
            queries,
            tokens,
            100 * wait / elapsed,
            _gpu_text(gpu),
            eta,
        )


def _gpu_text(gpu: dict) -> str:
    """' | gpu mem 812/1024 MB (peak 900/1024) | util 87%' (allocated/reserved), or '' without figures."""
    if not gpu:
        return ""
    text = " | gpu mem {:.0f}/{:.0f} MB (peak {:.0f}/{:.0f})".format(
        *(
            gpu[HISTORY[k]]
            for k in ("gpu_memory_allocated", "gpu_memory_reserved", "gpu_peak_allocated", "gpu_peak_reserved")
        )
    )
    if HISTORY["gpu_utilization"] in gpu:
        text += f" | util {gpu[HISTORY['gpu_utilization']]:.0f}%"
    return text


def log_eval(logger: NullLogger, is_main: bool, metrics: dict[str, float], step: int) -> None:
    logger.log_metrics({f"{DEV_PREFIX}{k}": v for k, v in metrics.items()}, step)
    if is_main:
        log.info("step %d: dev %s", step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
