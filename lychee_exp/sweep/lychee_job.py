"""What the sweeper adds when its trials are lychee_exp jobs: the trial's place in the study (so that rank 0
can report dev metrics and be pruned) and the out-of-memory retry. Any other Hydra app gets neither, and needs
no `trial` key: a job is recognised as lychee_exp's by its composed config, which has lychee_exp's `trial`
schema (lychee_exp.core.config.TrialConfig).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from lychee_exp.core.errors import UserError
from lychee_exp.core.global_step import check_global_step
from lychee_exp.sweep.space import render

STORAGE_ENV = "LYCHEE_TRIAL_STORAGE"
_TRIAL_KEYS = {"storage", "study_name", "number", "id", "pruner"}


def is_lychee_job(job_cfg: DictConfig) -> bool:
    trial = OmegaConf.select(job_cfg, "trial", default=None)
    return OmegaConf.is_dict(trial) and set(trial.keys()) >= _TRIAL_KEYS and "optimized_metric" in job_cfg


def check(
    job_cfg: DictConfig, space_keys: Sequence[str], directions: Sequence[str], objectives: Sequence[str] | None
) -> None:
    if not objectives and directions[0] == "minimize":  # every lychee_exp metric is better higher
        raise UserError(
            f"hydra.sweeper.direction=minimize would minimise optimized_metric={job_cfg.optimized_metric}: "
            "set hydra.sweeper.direction=maximize (as conf/hparams_search/lr_batch.yaml does)"
        )
    searched = [key for key in space_keys if key.lstrip("+").startswith("trial.")]
    if searched:
        raise UserError(
            f"hydra.sweeper.params: {searched[0]} is set by the sweeper for each trial and cannot be searched"
        )
    # the sample trial's global step against its batches: a mismatch would fail every trial the same way
    check_global_step(
        job_cfg.trainer.get("global_batch_size"),
        job_cfg.trainer.get("global_tokens_per_step"),
        job_cfg.data.get("max_tokens_per_batch"),
    )
    if len(directions) > 1 and len(objectives or []) != len(directions):
        raise UserError(
            f"hydra.sweeper.objectives={list(objectives or [])}: a lychee_exp job returns one metric; "
            f"{len(directions)} directions need as many metrics.json keys, e.g. [ndcg@10, train_time_s]"
        )


def trial_overrides(
    number: int, trial_id: int, storage_url: str, study_name: str, pruner_spec: dict, multi_objective: bool
) -> list[str]:
    overrides = [f"trial.number={number}"]
    if not multi_objective:  # optuna prunes single-objective studies only
        # the URL may hold a password: it travels in the environment (inherited by the ranks), so that
        # configs, logs and W&B only ever see the variable's name
        os.environ[STORAGE_ENV] = storage_url
        overrides += [
            f"trial.storage=env:{STORAGE_ENV}",
            f"trial.study_name={render(study_name)}",
            # ++: a dict merged into the schema's empty one needs force-add
            f"trial.id={trial_id}",
            f"++trial.pruner={render(pruner_spec)}",
        ]
    return overrides


def oom_retry_overrides(overrides: list[str], job_cfg: Any) -> tuple[list[str], dict] | None:
    """Half the micro-batch (the per-device batch, or the token budget when data.max_tokens_per_batch is set),
    the same effective batch in less memory: twice the accumulation, or, with trainer.global_batch_size or
    global_tokens_per_step, the same global step (the trial derives the accumulation from it).
    None when the micro-batch cannot be halved."""
    budget = job_cfg.data.get("max_tokens_per_batch")
    key, size = (
        ("data.max_tokens_per_batch", budget) if budget is not None else ("data.batch_size", job_cfg.data.batch_size)
    )
    fixed = {k: v for k in ("global_batch_size", "global_tokens_per_step") if (v := job_cfg.trainer.get(k)) is not None}
    if size < 2:
        return None
    changed = {key: size // 2}
    if not fixed:
        changed["trainer.grad_accum_steps"] = job_cfg.trainer.grad_accum_steps * 2
    kept = [line for line in overrides if line.split("=", 1)[0].lstrip("+") not in changed]
    record = {**{k.split(".", 1)[1]: v for k, v in changed.items()}, **fixed}
    return [*kept, *(f"{k}={v}" for k, v in changed.items())], record
