"""Early stopping and the best checkpoint, as Hugging Face's Trainer has them (trainer.metric_for_best_model,
trainer.load_best_model_at_end, trainer.early_stopping_patience / early_stopping_threshold; lychee_exp.train.best):
the saved model, scored afresh on the run's dev set, gives the best logged figure (and, restore off, the last one);
early stopping ends every DDP rank at the same evaluation, beside a sweep's pruner; the best, its checkpoint and the
patience count survive a resume; parallel=fsdp restores the sharded best.

The runs' figures get worse on purpose: the `zero` fault (tests/faults.py) zeroes the trainable weights after the
last step, so that the last evaluation scores every pair alike (the tie order's figure, the same on any machine) and
the best is an earlier one."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import logging
from pathlib import Path
from typing import Iterator

import pytest
import torch
from conftest import TINY_OVERRIDES, compose_config, run_metrics
from ddp_helpers import TINY_DDP
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from safetensors.torch import load_file
from step_log import STEP_LOG_ENV, steps_taken

from lychee_exp.cli import composition_error
from lychee_exp.config.schema import to_run_config
from lychee_exp.errors import UserError
from lychee_exp.ir import evaluate as ev
from lychee_exp.job.in_process import run_job
from lychee_exp.model.reranker import load_reranker
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.train.best import Best, best_figures, observe, patience_spent
from lychee_exp.train.inputs import load_inputs
from lychee_exp.train.trainer import Trainer

STEPS = 6
# every step evaluated; ndcg@10 the model's own (no teacher mix); no warmup, so that step 1 already moves the weights
EVERY_STEP = ["trainer.eval_every=1", "data.teacher_weight=0", "optimizer.warmup_ratio=0", "logger=csv"]
BEST = [*TINY_OVERRIDES, *EVERY_STEP, f"trainer.max_steps={STEPS}", "data.max_dev_queries=10"]
# checkpoints every 2 steps, only the newest kept: the best evaluation's survives beside it with the restore on
BEST += ["trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
# early stopping that no gain can reset (ndcg@10 <= 1): it stops exactly `patience` evaluations after the first
NO_GAIN_COUNTS = ["trainer.early_stopping_threshold=1.0"]


def reevaluate(run_dir: Path) -> dict[str, float]:
    """The run's model/ scored afresh on the run's own dev set (its config.yaml), as a user of model/ would."""
    cfg = to_run_config(OmegaConf.load(run_dir / "config.yaml"))
    model_cfg = dataclasses.replace(cfg.model, path=str(run_dir / "model"), random_init=False)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    inputs = load_inputs(cfg)
    pairs = inputs.dev_pairs(cfg.data.instruction or model_cfg.prompt.default_instruction, cfg.seed)
    model = load_reranker(model_cfg, inputs.encoder, cfg.seed)
    return ev.evaluate(model, inputs.encoder, pairs, cfg.data.eval_batch_size, torch.device("cpu"))


def dev_history(run_dir: Path, key: str = "dev/model_ndcg@10") -> dict[int, float]:
    """step -> the dev figure logged at that step (metrics.csv)."""
    with (run_dir / "metrics.csv").open() as handle:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(handle) if row.get(key)}


@contextlib.contextmanager
def trainer_log() -> Iterator[list[str]]:
    """The trainer's log lines (INFO and up) while the block runs."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("lychee_exp.train.trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def restore_runs(tmp_path_factory) -> dict[bool, tuple[Path, float, list[str]]]:
    """load_best_model_at_end -> (run directory, the job's return value, the trainer's log): the same run with the
    restore on and off, its weights zeroed after the last step."""
    root = tmp_path_factory.mktemp("best")
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LYCHEE_FAULT", f"0:{STEPS}:zero")
        for restore in (True, False):
            run_dir = root / f"restore-{restore}"
            with trainer_log() as lines:
                value, _ = run_job([*BEST, f"trainer.load_best_model_at_end={restore}"], run_dir)
            runs[restore] = (run_dir, value, lines)
    return runs


def test_the_saved_model_reevaluated_gives_the_best_logged_figure(restore_runs):
    run_dir, value, lines = restore_runs[True]
    m, history = run_metrics(run_dir), dev_history(run_dir)
    best_step = max(range(1, STEPS + 1), key=lambda step: (history[step], -step))  # the first of equal figures
    # the premise: the best is not the last (the zeroed model's tie-order figure is below the best trained one)
    assert m["steps"] == STEPS and best_step < STEPS and history[STEPS] < history[best_step]
    assert m["best_step"] == best_step and m["best_metric"] == history[best_step]
    assert m["metric_for_best_model"] == "model_ndcg@10"  # optimized_metric's default: the model's own
    # metrics.json's dev figures are the best evaluation's, the last one's headline figure kept beside them
    assert m["ndcg@10"] == history[best_step] and m["mrr@10"] == dev_history(run_dir, "dev/mrr@10")[best_step]
    assert m["last_model_ndcg@10"] == history[STEPS]
    again = reevaluate(run_dir)
    assert again["ndcg@10"] == pytest.approx(m["best_metric"], abs=1e-6)
    assert again["mrr@10"] == pytest.approx(m["mrr@10"], abs=1e-6)
    assert value == m["ndcg@10"]  # what a sweep receives: the best evaluation's optimized metric
    best_dir = run_dir / "checkpoints" / f"step_{best_step:06d}"
    assert any(f"model/ holds the best, restored from {best_dir}" in line for line in lines), lines
    # pruning (keep_checkpoints=1) kept the best evaluation's checkpoint beside the newest
    assert sorted(p.name for p in best_dir.parent.glob("step_*")) == sorted({best_dir.name, f"step_{STEPS:06d}"})


def test_without_the_restore_the_saved_model_is_the_last(restore_runs):
    run_dir, value, lines = restore_runs[False]
    m, history = run_metrics(run_dir), dev_history(run_dir)
    again = reevaluate(run_dir)
    # the check above fails here: model/ gives the last evaluation's figure, not the best one
    assert again["ndcg@10"] == pytest.approx(history[STEPS], abs=1e-6) == m["ndcg@10"]
    assert abs(again["ndcg@10"] - m["best_metric"]) > 1e-3
    # the best is tracked all the same, and the same as with the restore on
    on = run_metrics(restore_runs[True][0])
    assert (m["best_step"], m["best_metric"]) == (on["best_step"], on["best_metric"]) and "last_model_ndcg@10" not in m
    assert value == m["ndcg@10"] == history[STEPS]
    assert any("model/ holds the last (trainer.load_best_model_at_end=true" in line for line in lines), lines
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{STEPS:06d}"]


def test_best_and_patience_follow_hugging_face():
    """EarlyStoppingCallback.check_metric_value and Trainer._determine_best_metric: the best moves with any gain;
    the count restarts only on a gain above the threshold."""
    best = Best()
    seen = [observe(best, step, {"ndcg@10": v}, "ndcg@10", 0.05) for step, v in enumerate([0.5, 0.52, 0.51, 0.6], 1)]
    assert seen == [True, True, False, True] and best.step == 4 and best.stale == 0
    observe(best, 5, {"ndcg@10": 0.6}, "ndcg@10", 0.0)  # equal is no gain
    assert (best.step, best.stale) == (4, 1) and not patience_spent(best, 2) and patience_spent(best, 1)
    assert not patience_spent(best, 0)  # 0: early stopping off
    # a model_* name reads the unprefixed figure where the run wrote no model_* key (nothing mixed in)
    assert observe(Best(), 1, {"ndcg@10": 0.3}, "model_ndcg@10", 0.0)
    with pytest.raises(KeyError, match="no map"):
        observe(Best(), 1, {"ndcg@10": 0.3}, "map", 0.0)
    assert best_figures(Best(), "ndcg@10", {}, True) == {}  # no evaluation during training: nothing to report


@pytest.mark.parametrize("key", ["trainer.metric_for_best_model", "optimized_metric"])
def test_a_metric_the_dev_evaluation_does_not_give_is_one_line(tmp_path, key):
    """Both names are the same closed choice (config.choices.Metric: figures every dev protocol gives), refused
    while the config composes, before any process starts."""
    with pytest.raises(ConfigCompositionException) as caught:
        compose_config([*TINY_OVERRIDES, f"{key}=map"], tmp_path)
    assert composition_error(caught.value).startswith(f"{key}: Invalid value 'map', expected one of [model_ndcg@10, ")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.evaluate=false", "trainer.load_best_model_at_end=true"], "trainer.load_best_model_at_end ranks"),
        (["trainer.evaluate=false", "trainer.early_stopping_patience=2"], "trainer.early_stopping_patience ranks"),
        (["trainer.early_stopping_threshold=-0.1"], "trainer.early_stopping_threshold must be >= 0"),
    ],
)
def test_a_setting_without_dev_figures_is_one_line_before_training(tmp_path, overrides, message):
    with pytest.raises(UserError, match=f"^{message}") as err:
        run_job([*TINY_OVERRIDES, *overrides], tmp_path)
    assert "\n" not in str(err.value) and not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize("pruned_at", [None, 3, 2], ids=["early-stopping", "both-at-once", "pruner-first"])
def test_early_stopping_votes_beside_the_pruner(tmp_path, pruned_at):
    """Early stopping (patience 2) ends the run at its third evaluation during training; a pruner beside it reports
    every evaluation, step 0's included, and wins when both vote at once (the trial is then pruned)."""
    cfg = to_run_config(
        compose_config(
            [
                *TINY_OVERRIDES,
                *EVERY_STEP,
                *NO_GAIN_COUNTS,
                "trainer.max_steps=8",
                "trainer.early_stopping_patience=2",
                "trainer.save_model=false",
            ],
            tmp_path,
        )
    )
    reported: list[int] = []

    def pruner(step: int, metrics: dict) -> bool:
        reported.append(step)
        return step == pruned_at

    plan = plan_devices("single", 1, cuda_count=0, cpu_threads_per_rank=1)
    trainer = Trainer(cfg, DistEnv(), plan, tmp_path, [pruner])
    trainer.setup()
    metrics = trainer.fit()
    trainer.cleanup()
    stop = pruned_at or 3
    assert metrics["steps"] == stop and reported == list(range(stop + 1)) and metrics["stopped_early"] is True
    assert metrics["stop_reason"] == ("early_stopping" if pruned_at is None else "pruned")


def test_an_early_stopped_trial_is_complete_a_pruned_one_is_not(tmp_path):
    import json

    from hydra.core.utils import JobReturn, JobStatus

    from lychee_exp.sweep.outcome import job_outcome

    done = JobReturn()
    done.status, done.return_value = JobStatus.COMPLETED, 0.4
    for reason, state in (("early_stopping", "COMPLETE"), ("pruned", "PRUNED")):
        (tmp_path / "metrics.json").write_text(
            json.dumps({"ndcg@10": 0.4, "stopped_early": True, "stop_reason": reason})
        )
        assert job_outcome(done, tmp_path, 1, None).state == state


def test_early_stopping_ends_every_ddp_rank_at_the_same_evaluation(tmp_path, monkeypatch):
    """2 gloo ranks, patience 2, no gain counting: every rank's last step is the third evaluation's, and model/ (the
    best, restored on both ranks) scores as the best logged figure. A rank that went on training would wait in its
    next gradient all-reduce: the short collective timeout fails the run instead of hanging the test."""
    monkeypatch.setenv("LYCHEE_STEP_HOOK", "step_log:step_log")
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path))
    args = [*TINY_DDP, *EVERY_STEP, *NO_GAIN_COUNTS, "parallel=ddp", "gpus=2", "trainer.max_steps=8"]
    args += ["trainer.early_stopping_patience=2", "trainer.load_best_model_at_end=true", "parallel.timeout_s=120"]
    _, m = run_job(args, tmp_path / "run")
    assert steps_taken(tmp_path) == {"rank0": [1, 2, 3], "rank1": [1, 2, 3]}
    assert m["steps"] == 3 and m["stop_reason"] == "early_stopping" and m["num_devices"] == 2
    assert reevaluate(tmp_path / "run")["ndcg@10"] == pytest.approx(m["best_metric"], abs=1e-6) == m["ndcg@10"]


def test_a_resumed_run_keeps_the_best_and_the_patience_count(tmp_path, monkeypatch):
    """Killed after step 3 (step 2's checkpoint on disk), resumed: it stops where the whole run stops (patience 3
    counts on from step 2's count) with the same best and the same model/. Losing the count would stop it at step 5,
    losing the best at step 6."""
    args = [*BEST, *NO_GAIN_COUNTS, "trainer.early_stopping_patience=3", "trainer.load_best_model_at_end=true"]
    _, whole = run_job(args, tmp_path / "whole")
    monkeypatch.setenv("LYCHEE_FAULT", "0:3:raise")
    with pytest.raises(Exception, match="injected fault on rank 0 at step 3"):
        run_job(args, tmp_path / "cut")
    monkeypatch.delenv("LYCHEE_FAULT")
    _, resumed = run_job([*args, "trainer.resume=auto"], tmp_path / "cut")
    assert whole["steps"] == resumed["steps"] == 4 and resumed["stop_reason"] == "early_stopping"
    for key in ("best_step", "best_metric", "ndcg@10", "mrr@10", "last_model_ndcg@10"):
        assert resumed[key] == pytest.approx(whole[key], abs=1e-9), key
    assert reevaluate(tmp_path / "cut")["ndcg@10"] == pytest.approx(whole["best_metric"], abs=1e-6)


def test_a_lora_run_restores_its_best_adapters(tmp_path):
    """LoRA checkpoints hold the adapters only (the base comes from model.path again): the best's come back into
    model/. No fault here (zeroed adapters are the base model, as good as step 0): at lr 1e-2 the figures fall after
    a few steps, which the test checks first."""
    lora = ["model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0"]
    args = [*BEST, *lora, "optimizer.lr=1e-2", "trainer.load_best_model_at_end=true"]
    _, m = run_job(args, tmp_path)
    history = dev_history(tmp_path)
    assert m["best_step"] < STEPS and history[STEPS] < m["best_metric"] == m["ndcg@10"]  # the premise
    best_dir = tmp_path / "checkpoints" / f"step_{m['best_step']:06d}"
    saved = load_file(str(best_dir / "model.safetensors"))
    assert saved and all("lora_" in name for name in saved)
    assert reevaluate(tmp_path)["ndcg@10"] == pytest.approx(m["best_metric"], abs=1e-6)


@pytest.mark.slow
def test_fsdp_restores_the_sharded_best(tmp_path, monkeypatch):
    """parallel=fsdp on 2 CPU ranks: the best evaluation's DCP shards come back on both ranks and model/ (gathered
    from them) scores as the best logged figure, not as the zeroed last step."""
    monkeypatch.setenv("LYCHEE_FAULT", f"0:{STEPS}:zero,1:{STEPS}:zero")
    args = [*TINY_DDP, *EVERY_STEP, "parallel=fsdp", "gpus=2", "data.batch_size=1", f"trainer.max_steps={STEPS}"]
    _, m = run_job([*args, "trainer.load_best_model_at_end=true"], tmp_path)
    history = dev_history(tmp_path)
    assert m["best_step"] < STEPS and history[STEPS] < m["best_metric"] == m["ndcg@10"]
    assert (tmp_path / "checkpoints" / f"step_{m['best_step']:06d}" / "shards" / ".metadata").is_file()
    assert reevaluate(tmp_path)["ndcg@10"] == pytest.approx(m["best_metric"], abs=1e-6)
