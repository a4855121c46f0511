"""Entry point: `python -m lychee_exp.run [overrides]` (or `lychee-run`), a Hydra app.

The story of a run: compose and check the config, check the inputs, plan the devices, launch the ranks,
write metrics.json from rank 0's results, and return the optimized metric to whichever sweeper asked.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import sys
from datetime import datetime
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lychee_exp.config import RunConfig, register_schema, to_run_config
from lychee_exp.data import check_negatives, load_queries
from lychee_exp.devices import plan_devices
from lychee_exp.errors import RunFailed, UserError
from lychee_exp.launcher import launch, under_torchrun
from lychee_exp.model import build_encoder, load_tokenizer
from lychee_exp.speedup import resolve_baseline, store_baseline

log = logging.getLogger("lychee_exp")


def run_stamp() -> str:
    """Run directory name. Under torchrun every rank computes it, so it must not depend on the moment:
    it comes from the rendezvous id that all ranks share (launch/torchrun.sh sets LYCHEE_RUN_STAMP)."""
    if os.environ.get("LYCHEE_RUN_STAMP"):
        return os.environ["LYCHEE_RUN_STAMP"]
    if under_torchrun():
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        return f"{datetime.now():%Y-%m-%d}_torchrun-{run_id}" if run_id != "none" else \
            f"{datetime.now():%Y-%m-%d_%H-%M}_torchrun"
    # the suffix keeps two runs started in the same second apart
    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}_{secrets.token_hex(2)}"


register_schema()
OmegaConf.register_new_resolver("lychee_stamp", run_stamp, use_cache=True, replace=True)


def preflight(cfg: RunConfig) -> None:
    """Everything a user can get wrong, checked before any training process starts."""
    check_negatives(load_queries(cfg.data.train_file, "data.train_file", cfg.data.max_train_queries),
                    cfg.data.train_group_size, cfg.data.random_negatives)
    load_queries(cfg.data.dev_file, "data.dev_file", cfg.data.max_dev_queries)
    encoder = build_encoder(cfg.model, load_tokenizer(cfg.model))
    if cfg.model.kind == "causal_lm":
        encoder.single_token_id("model.prompt.yes_token", cfg.model.prompt.yes_token)
        encoder.single_token_id("model.prompt.no_token", cfg.model.prompt.no_token)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Readers see the old file or the whole new one, never a partial write."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _job_log_file() -> str | None:
    """The Hydra job's log file, which rank 0 of a spawned run keeps writing to."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def run(cfg: DictConfig) -> float:
    """Runs one training job from a composed config and returns its optimized metric."""
    try:
        run_cfg = to_run_config(cfg)
    except OmegaConfBaseException as err:
        raise UserError(f"{err.full_key or 'config'}: {str(err).splitlines()[0]}") from None
    if under_torchrun() and _in_sweep():
        raise UserError("-m sweeps cannot run under torchrun (every rank would sample its own hyperparameters); "
                        "run the sweep without torchrun: each trial launches its own ranks")
    is_main = os.environ.get("RANK", "0") == "0"  # under torchrun only global rank 0 writes outputs
    output_dir = Path(run_cfg.output_dir)
    metrics_path = output_dir / "metrics.json"
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.unlink(missing_ok=True)  # a stale result must not pass for this run's
    preflight(run_cfg)
    plan = plan_devices(run_cfg.parallel.strategy, run_cfg.gpus,
                        cpu_threads_per_rank=run_cfg.parallel.cpu_threads_per_rank)
    if is_main:
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(run_cfg)))

    if is_main and not under_torchrun():
        baseline = resolve_baseline(run_cfg, plan, output_dir)
        run_cfg = dataclasses.replace(run_cfg, speedup=dataclasses.replace(run_cfg.speedup,
                                                                          baseline_samples_per_s=baseline))
    metrics = launch(run_cfg, plan, output_dir, _job_log_file())
    metrics["optimized_metric"] = run_cfg.optimized_metric
    if is_main and plan.num_devices == 1 and plan.strategy != "dp" and not under_torchrun():
        store_baseline(run_cfg, plan, metrics["train_samples_per_s"], f"run {output_dir}")
    if is_main:
        write_json_atomic(metrics_path, metrics)
        if "ndcg@10" in metrics:
            log.info("dev ndcg@10 %.4f (untrained %.4f, BM25 %.4f), mrr@10 %.4f", metrics["ndcg@10"],
                     metrics.get("initial_ndcg@10", float("nan")), metrics.get("bm25_ndcg@10", float("nan")),
                     metrics["mrr@10"])
        log.info("%d steps in %.0f s: %.1f samples/s on %d device(s), effective batch %d; speedup %.2fx over %s "
                 "(scaling efficiency %.0f%%)", metrics["steps"], metrics["train_time_s"],
                 metrics["train_samples_per_s"], metrics["world_size"], metrics["effective_batch_size"],
                 metrics["speedup"], metrics["speedup_baseline"], 100 * metrics["scaling_efficiency"])
        log.info("results in %s", output_dir)
    return float(metrics.get(run_cfg.optimized_metric, float("nan")))  # nan: trainer.evaluate=false


def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        return run(cfg)
    except (UserError, RunFailed) as err:
        log.error("error: %s", err)
        if _in_sweep():
            raise  # the sweeper records the trial as failed, with this reason, and goes on
        # A user mistake (2) or a failed run (1) gets one line, not a traceback.
        sys.exit(2 if isinstance(err, UserError) else 1)


if __name__ == "__main__":
    main()
