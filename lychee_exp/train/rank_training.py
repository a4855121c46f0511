"""What a rank calls to train: the Trainer's setup -> fit -> save -> cleanup, with a sweep trial's pruning callback."""

from __future__ import annotations

from pathlib import Path

from lychee_exp.config.schema import RunConfig
from lychee_exp.parallel.devices import DevicePlan
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.tracking.trial import current_trial, pruning_callback
from lychee_exp.train.inputs import RunInputs
from lychee_exp.train.progress import NO_HOOKS, NOTHING_LEFT, StepHooks
from lychee_exp.train.trainer import Trainer


def train_on_rank(
    cfg: RunConfig,
    env: DistEnv,
    plan: DevicePlan,
    output_dir: Path,
    inputs: RunInputs | None = None,
    hooks: StepHooks = NO_HOOKS,
) -> dict:
    """setup -> fit -> save -> cleanup on this rank; every rank returns the same metrics."""
    callbacks, trial = [], current_trial()
    if trial is not None and trial.storage and env.is_main:
        callbacks.append(pruning_callback(trial, cfg.optimized_metric))
    trainer = Trainer(cfg, env, plan, output_dir, callbacks, inputs, hooks)
    try:
        trainer.setup()
        metrics = trainer.fit()
        if "preempted_at_step" not in metrics and NOTHING_LEFT not in metrics:
            trainer.save()
    finally:
        trainer.cleanup()
    return metrics
