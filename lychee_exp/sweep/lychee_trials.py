"""What the sweeper adds when its trials are lychee_exp jobs: each trial's TrialContext (its place in the study,
so that rank 0 can report dev metrics and be pruned), passed beside the run's config, and the out-of-memory
retry. Any other Hydra app gets neither: a job is recognised as lychee_exp's by its composed config, typed by
lychee_exp's schema (RunConfig).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from lychee_exp.config.auto import check_global_step
from lychee_exp.errors import UserError
from lychee_exp.sweep.space import render
from lychee_exp.tracking.trial import TRIAL_ENV, TrialContext

STORAGE_ENV = "LYCHEE_TRIAL_STORAGE"


def is_lychee_job(job_cfg: DictConfig) -> bool:
    schema = OmegaConf.get_type(job_cfg)
    return getattr(schema, "__qualname__", "") == "RunConfig" and schema.__module__.startswith("lychee_exp.")


def check(
    job_cfg: DictConfig, space_keys: Sequence[str], directions: Sequence[str], objectives: Sequence[str] | None
) -> None:
    if not objectives and directions[0] == "minimize":  # every lychee_exp metric is better higher
        raise UserError(
            f"hydra.sweeper.direction=minimize would minimise optimized_metric={job_cfg.optimized_metric}: "
            "set hydra.sweeper.direction=maximize (as conf/hparams_search/lr_batch.yaml does)"
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
            f"{len(directions)} directions need as many metrics.json keys, e.g. [model_ndcg@10, train_time_s]"
        )


def trial_override(trial: TrialContext, storage_url: str) -> str:
    """The override that hands the trial its context: an environment variable Hydra sets while the job runs."""
    if trial.storage:
        # the URL may hold a password: it travels in the environment (inherited by the ranks), so that
        # configs, logs and W&B only ever see the variable's name
        os.environ[STORAGE_ENV] = storage_url
    return f"++hydra.job.env_set.{TRIAL_ENV}={render(trial.to_json())}"


def trial_context(
    number: int, trial_id: int, study_name: str, pruner_spec: dict, multi_objective: bool, placement: dict
) -> TrialContext:
    if multi_objective:  # optuna prunes single-objective studies only
        return TrialContext(study_name, number, placement=placement)
    pruner = {key: value for key, value in pruner_spec.items() if value is not None or key == "_target_"}
    return TrialContext(study_name, number, trial_id, f"env:{STORAGE_ENV}", pruner, placement)


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
