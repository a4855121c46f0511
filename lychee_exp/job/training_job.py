"""One training job in the Hydra process: check the config, plan the devices, run the data's steps (data=beir:
mine the train split and score the dev split's candidates, into the cache), check the inputs, launch the ranks
(which measure their own speedup baseline, lychee_exp.train.baseline_phase), write metrics.json from rank 0's
results, and return the optimized metric."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lychee_exp.config.auto import packing_on, with_global_batch
from lychee_exp.config.schema import RunConfig, to_run_config
from lychee_exp.data.budget import check_token_budget
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.ir.training import prepare_beir
from lychee_exp.job.context import in_sweep, trials_run_here
from lychee_exp.job.results import nothing_left, write_results
from lychee_exp.job.run_dir import check_resumed_model, commit_run_dir
from lychee_exp.launch.cluster import is_main_process, job_devices, local_ranks, under_torchrun
from lychee_exp.model.files import model_choice, resolve_model
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.tracking.memory import release_freed_memory
from lychee_exp.tracking.phases import PEAKS, hand_down, hydra_figures, phase
from lychee_exp.train.inputs import RunInputs, load_inputs, model_inputs
from lychee_exp.train.losses import LOSSES
from lychee_exp.train.optim import OPTIMIZERS

log = logging.getLogger("lychee_exp")


def preflight(cfg: RunConfig, device_type: str = "cpu", strategy: str = "single") -> RunInputs:
    """Everything a user can get wrong, checked before any training process starts; returns the inputs read,
    which the ranks that train in this process reuse. The token budget is checked packed or padded as the ranks
    on `device_type` will batch (data.packing=auto decides per device). A check only reads: with data=beir it reads
    what prepare_data's steps cached, and without them refuses in one line (it never mines or scores)."""
    check_settings(cfg)
    inputs = load_inputs(cfg)
    check_token_budget(cfg, inputs, packing_on(cfg, device_type, strategy))
    return inputs


def check_settings(cfg: RunConfig) -> None:
    """The checks that read no data: the loss and optimizer names, the logger's package."""
    LOSSES.lookup(cfg.loss.name)
    OPTIMIZERS.lookup(cfg.optimizer.name)
    tensorboard = cfg.logger.name == "tensorboard" or (cfg.logger.tensorboard and cfg.logger.name != "none")
    if tensorboard and importlib.util.find_spec("tensorboard") is None:  # else rank 0 would fail at its first log
        raise UserError("logger: TensorBoard's event files need the tensorboard package (pip install tensorboard)")


def prepare_data(cfg: RunConfig) -> RunConfig:
    """data=beir's steps (ir.training.prepare_beir: the train split mined when data.train_file is empty, the dev
    split's candidates retrieved and scored by the teacher, each into the cache, each said in the log), once the
    checks that need none of it have passed: a wrong setting or model path is one line before minutes of mining.
    Returns the run's config with the mined file as data.train_file, which preflight, config.yaml and the ranks
    read. Every process that runs a job runs them (each torchrun rank, each SLURM node): one computes each entry,
    the others wait for it and read it. Other data: cfg as it is."""
    if not cfg.data.dataset:
        return cfg
    check_settings(cfg)
    model_inputs(cfg)
    train_file = prepare_beir(cfg.data, cfg.trainer.progress_bar, phase)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_file=train_file))


def job_log_file() -> str | None:
    """The Hydra job's log file, which rank 0 of a spawned run keeps writing to."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def train_job(cfg: DictConfig) -> float:
    """Runs one training job from a composed config and returns its optimized metric."""
    try:
        run_cfg = to_run_config(with_model_resolved(cfg))
    except OmegaConfBaseException as err:
        raise UserError(f"{err.full_key or 'config'}: {str(err).splitlines()[0]}") from None
    if under_torchrun() and in_sweep():
        raise UserError(
            "-m sweeps cannot run under torchrun (every rank would sample its own hyperparameters); "
            "run the sweep without torchrun: each trial launches its own ranks"
        )
    is_main = is_main_process()  # under torchrun global rank 0, on SLURM the first node: the one that writes
    output_dir = Path(run_cfg.output_dir)
    if is_main:
        check_resumed_model(run_cfg.trainer.resume, output_dir, dataclasses.asdict(run_cfg.model))
    # under torchrun `gpus` is its ranks on this node, so CPU threads per rank follow the in-process rule
    plan = plan_devices(
        run_cfg.parallel.strategy,
        local_ranks() or run_cfg.gpus,
        cpu_threads_per_rank=run_cfg.parallel.cpu_threads_per_rank,
        cpu_offload=run_cfg.parallel.cpu_offload,
    )
    PEAKS.clear()  # this job's phases (a sweep runs several jobs in this process)
    run_cfg = prepare_data(run_cfg)
    with phase("checks"):
        inputs = preflight(run_cfg, plan.device_type, plan.strategy)
    # the searched (effective) batch stays the same on whatever devices a sweep slot gives the trial; counted over
    # every node's devices (the plan is this node's until the ranks have joined)
    run_cfg = with_global_batch(run_cfg, job_devices(plan.num_devices))
    if is_main:
        # every check has passed: from here on the run may change (until now a continued run was as it had been;
        # its metrics.json and model/ stay until the ranks write new ones)
        commit_run_dir(output_dir)
        write_text_atomic(output_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(run_cfg)))
    # the launcher (and through it the recipe, transformers, peft) only once the checks passed: a user mistake
    # is reported without loading the training stack
    from lychee_exp.launch.launcher import launch
    from lychee_exp.train.progress import NOTHING_LEFT

    hand_down(PEAKS.snapshot())  # rank 0's logger summary holds this process's phases too
    release_freed_memory()  # what the data steps freed (the dense teacher's batches), while the ranks train
    with phase("ranks"):
        metrics = launch(run_cfg, plan, output_dir, job_log_file(), inputs, keep_ranks=trials_run_here())
    metrics.update(hydra_figures(PEAKS.snapshot()))
    if NOTHING_LEFT in metrics:
        return nothing_left(run_cfg, output_dir, metrics[NOTHING_LEFT], is_main)
    return write_results(run_cfg, metrics, output_dir, is_main)


def with_model_resolved(cfg: DictConfig) -> DictConfig | dict:
    """The job's config with its model as model.files.resolve_model reads it: the card of a model.path given
    on the command line wins over the default preset, unless a preset was chosen (model=, or an experiment's)."""
    if not HydraConfig.initialized():
        return cfg
    hydra_cfg = HydraConfig.get()
    chosen = hydra_cfg.runtime.choices.get("model")
    choice = model_choice(hydra_cfg.overrides.task, chosen if chosen != _default_preset(hydra_cfg) else None)
    if not choice.gave("path"):
        return cfg
    container = OmegaConf.to_container(cfg, resolve=True)
    container["model"] = resolve_model(container["model"], choice)
    return container


def _default_preset(hydra_cfg) -> str | None:
    """The model preset the primary config's defaults list picks (conf/config.yaml)."""
    main = next((s.path for s in hydra_cfg.runtime.config_sources if s.provider == "main"), None)
    if not main or hydra_cfg.job.config_name is None:
        return None
    primary = Path(main) / f"{hydra_cfg.job.config_name}.yaml"
    entries = OmegaConf.load(primary).get("defaults", []) if primary.is_file() else []
    return next((entry["model"] for entry in entries if isinstance(entry, DictConfig) and "model" in entry), None)
