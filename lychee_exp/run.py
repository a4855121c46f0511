"""Entry point: `python -m lychee_exp.run [overrides]` (or `lychee-run`), a Hydra app.

The story of a run: compose and check the config, check the inputs, plan the devices, launch the ranks,
write metrics.json from rank 0's results, and return the optimized metric to whichever sweeper asked.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lychee_exp.atomic import write_json_atomic
from lychee_exp.cluster import is_main_process, launched_externally, local_ranks, under_torchrun
from lychee_exp.config import RunConfig, register_schema, to_run_config
from lychee_exp.devices import plan_devices
from lychee_exp.errors import RunFailed, UserError
from lychee_exp.inputs import RunInputs, load_inputs
from lychee_exp.launcher import launch, train_in_process
from lychee_exp.losses import LOSSES
from lychee_exp.optim import OPTIMIZERS
from lychee_exp.speedup import resolve_baseline, store_baseline

log = logging.getLogger("lychee_exp")
# absolute: `lychee-run` imports this module by name, and Hydra would read a relative path as a python package
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def run_stamp() -> str:
    """Run directory name. Under torchrun every rank computes it, so it must not depend on the moment:
    it comes from the rendezvous id that all ranks share (launch/torchrun.sh sets LYCHEE_RUN_STAMP)."""
    if os.environ.get("LYCHEE_RUN_STAMP"):
        return os.environ["LYCHEE_RUN_STAMP"]
    if under_torchrun():
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        return (
            f"{datetime.now():%Y-%m-%d}_torchrun-{run_id}"
            if run_id != "none"
            else f"{datetime.now():%Y-%m-%d_%H-%M}_torchrun"
        )
    # the suffix keeps two runs started in the same second apart
    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}_{secrets.token_hex(2)}"


register_schema()
OmegaConf.register_new_resolver("lychee_stamp", run_stamp, use_cache=True, replace=True)


def preflight(cfg: RunConfig) -> RunInputs:
    """Everything a user can get wrong, checked before any training process starts; returns the inputs read,
    which the ranks that train in this process reuse."""
    LOSSES.lookup(cfg.loss.name)
    OPTIMIZERS.lookup(cfg.optimizer.name)
    return load_inputs(cfg)


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
        raise UserError(
            "-m sweeps cannot run under torchrun (every rank would sample its own hyperparameters); "
            "run the sweep without torchrun: each trial launches its own ranks"
        )
    is_main = is_main_process()  # under torchrun global rank 0, on SLURM the first node: the one that writes
    output_dir = Path(run_cfg.output_dir)
    metrics_path = output_dir / "metrics.json"
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.unlink(missing_ok=True)  # a stale result must not pass for this run's
    inputs = preflight(run_cfg)
    # under torchrun `gpus` is its ranks on this node, so CPU threads per rank follow the in-process rule
    plan = plan_devices(
        run_cfg.parallel.strategy,
        local_ranks() or run_cfg.gpus,
        cpu_threads_per_rank=run_cfg.parallel.cpu_threads_per_rank,
    )
    if is_main:
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(run_cfg)))

    if is_main:
        # ranks started elsewhere (torchrun, other nodes) cannot wait for a calibration here: cache or given only
        calibrate = run_cfg.speedup.calibrate and not launched_externally()
        speedup = dataclasses.replace(run_cfg.speedup, calibrate=calibrate)
        baseline = resolve_baseline(
            dataclasses.replace(run_cfg, speedup=speedup),
            plan,
            lambda cfg, one: train_in_process(cfg, one, output_dir, inputs),
        )
        run_cfg = dataclasses.replace(
            run_cfg, speedup=dataclasses.replace(run_cfg.speedup, baseline_samples_per_s=baseline)
        )
    metrics = launch(run_cfg, plan, output_dir, _job_log_file(), inputs, keep_ranks=_trials_run_here())
    metrics["optimized_metric"] = str(run_cfg.optimized_metric)
    if is_main and plan.num_devices == 1 and plan.strategy != "dp" and not launched_externally():
        store_baseline(run_cfg, plan, metrics["train_samples_per_s"], f"run {output_dir}")
    if is_main and not math.isfinite(metrics.get("speedup", 0.0)):
        for key in ("speedup", "scaling_efficiency"):
            metrics.pop(key, None)  # absent, not NaN: there was nothing to compare with
        log.info(
            "speedup: no single-device baseline for this setting (cached in %s, or speedup.baseline_samples_per_s)"
            "; metrics.json has no speedup",
            run_cfg.speedup.baseline_file,
        )
    if is_main:
        write_json_atomic(metrics_path, metrics)
        if "ndcg@10" in metrics:
            # the references this run measured: untrained (eval_before_training), BM25, the dev file's teacher
            names = {"initial_ndcg@10": "untrained", "bm25_ndcg@10": "BM25", "teacher_ndcg@10": "teacher"}
            refs = ", ".join(f"{name} {metrics[key]:.4f}" for key, name in names.items() if key in metrics)
            log.info("dev ndcg@10 %.4f (%s), mrr@10 %.4f", metrics["ndcg@10"], refs, metrics["mrr@10"])
        speedup_note = (
            (
                f"; speedup {metrics['speedup']:.2f}x over {metrics['speedup_baseline']} (scaling "
                f"efficiency {100 * metrics['scaling_efficiency']:.0f}%)"
            )
            if "speedup" in metrics
            else ""
        )
        log.info(
            "%d steps in %.0f s: %.1f samples/s on %d device(s), effective batch %d%s",
            metrics["steps"],
            metrics["train_time_s"],
            metrics["train_samples_per_s"],
            metrics["world_size"],
            metrics["effective_batch_size"],
            speedup_note,
        )
        log.info("results in %s", output_dir)
    return float(metrics.get(run_cfg.optimized_metric, float("nan")))  # nan: trainer.evaluate=false


def _in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _trials_run_here() -> bool:
    """A sweep whose trials run one after another in this process (Hydra's basic launcher): the DDP ranks of
    one trial can serve the next. Under submitit each trial is a job of its own, and its ranks end with it."""
    return _in_sweep() and str(HydraConfig.get().launcher.get("_target_", "")).endswith(".BasicLauncher")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    try:
        return run(cfg)
    except (UserError, RunFailed) as err:
        log.error("error: %s", err)
        if _in_sweep():
            raise  # the sweeper records the trial as failed, with this reason, and goes on
        # A user mistake (2) or a failed run (1) gets one line, not a traceback.
        sys.exit(2 if isinstance(err, UserError) else 1)


def main() -> None:
    """The CLI (`python -m lychee_exp.run`, `lychee-run`). A config that does not compose (a misspelt key, a
    wrong type, a value outside a closed choice) is a user mistake too: one line naming the key, exit 2.
    Hydra would print several lines, so it is asked to raise instead of printing (HYDRA_FULL_ERROR)."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except (ConfigCompositionException, OverrideParseException) as err:
        print(f"error: {composition_error(err)}", file=sys.stderr)
        sys.exit(2)


def composition_error(err: Exception) -> str:
    """Hydra's multi-line composition error as one line: the key, then what is wrong with it."""
    if isinstance(err, MissingConfigException) and err.options:
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        return f"{group}={name}: no such option in conf/{group}; options: {', '.join(sorted(err.options))}"
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return f"{cause.full_key}: {str(cause).splitlines()[0]}"
    return " ".join(str(err).split())


if __name__ == "__main__":
    main()
