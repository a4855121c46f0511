"""The training recipe: setup -> fit (train with periodic dev evaluation) -> save -> cleanup, on one rank of a run.

Every rank runs this same code; only the main rank logs, shows progress and saves. A step is one optimizer
update over `grad_accum_steps` micro-batches of `data.batch_size` queries on each of `num_devices` devices.
The parts (model, data, loss, optimizer, logger) come from the library modules named for them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from lychee_exp import evaluate as ev
from lychee_exp.bucketing import length_chunks, padded_slots
from lychee_exp.checkpoint import latest_checkpoint, restore_training_state, save_training_state
from lychee_exp.config import RunConfig
from lychee_exp.data import TrainGroups, build_dev_pairs
from lychee_exp.devices import DevicePlan, resolve_precision
from lychee_exp.distributed import DistEnv, wrap_for_training
from lychee_exp.errors import TrainingDiverged
from lychee_exp.faults import fault_hook
from lychee_exp.inputs import RunInputs, load_inputs
from lychee_exp.loader import train_loader
from lychee_exp.loggers import log_eval, log_setup, log_train_step, run_logger
from lychee_exp.losses import build_loss
from lychee_exp.model import count_parameters, load_reranker, save_reranker
from lychee_exp.optim import build_optimizer, optimizer_step, scaled_lr
from lychee_exp.preemption import stop_requested
from lychee_exp.throughput import StepTimer, log_hints, setup_facts, speedup_facts, summarize

log = logging.getLogger(__name__)

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # set both ways: a warm rank's earlier trial may have turned it on
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # Deterministic mode also fills every new tensor's memory (NaN) in case an op reads it uninitialized; none of
    # ours does, and the fill cost 2% of a CPU step (MiniLM, 3 interleaved rounds), more on a GPU's allocations.
    torch.utils.deterministic.fill_uninitialized_memory = False


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        plan: DevicePlan,
        output_dir: Path,
        eval_callbacks: Sequence[Callable[[int, dict], bool]] = (),
        inputs: RunInputs | None = None,
    ):
        self.cfg, self.env, self.plan, self.output_dir = cfg, env, plan, output_dir
        self.eval_callbacks = list(eval_callbacks)  # (step, dev metrics) -> True to stop; main rank only
        self.inputs = inputs  # read by this process's preflight already, else loaded in setup
        self.device = env.device
        self.num_devices = plan.num_devices  # devices whose batches make one step (DDP ranks or DP GPUs)

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        seed_everything(cfg.seed, cfg.trainer.deterministic)
        inputs = self.inputs or load_inputs(cfg, warn_unknown=False)  # the Hydra process warned already
        self._setup_model(inputs)
        self._setup_data(inputs)
        self._setup_optimizer()
        self.loss_fn = build_loss(cfg.loss, cfg.data.train_group_size)
        self.after_step = fault_hook(self.env.rank, cfg.trial.number)  # None outside failure-handling tests
        self.resume_from = self._resume_path()
        self.facts = setup_facts(cfg, self.env, self.plan, self.lr, self.precision, count_parameters(self.model))
        self.logger = run_logger(cfg, self.output_dir, self.env.is_main, self.facts)
        self.eval_time_s = 0.0
        self.stopped = False  # set when an evaluation callback (e.g. a sweep's pruner) ends the run early
        if self.env.is_main:
            schedule = (self.total_steps, self.steps_per_epoch, self.warmup_steps)
            log_setup(cfg, self.facts, len(self.train_set), self.dev_pairs, *schedule)

    def _setup_model(self, inputs: RunInputs) -> None:
        self.tokenizer, self.encoder = inputs.tokenizer, inputs.encoder
        self.model = load_reranker(self.cfg.model, self.encoder, self.cfg.seed).to(self.device)
        self.precision = resolve_precision(self.cfg.trainer.precision, self.device)
        self.train_model = wrap_for_training(self.model, self.env, self.plan, self.cfg.parallel.find_unused_parameters)

    def _setup_data(self, inputs: RunInputs) -> None:
        cfg, env, data = self.cfg, self.env, self.cfg.data
        instruction = data.instruction or cfg.model.prompt.default_instruction
        self.train_set = TrainGroups(
            inputs.train_queries, data.train_group_size, instruction, cfg.seed, data.random_negatives
        )
        self.dev_pairs = build_dev_pairs(inputs.dev_queries, self.encoder, instruction, cfg.seed)
        # DataParallel splits one process's batch over its GPUs, so that process loads all of their batches.
        loader_batch = data.batch_size * (self.num_devices if self.plan.strategy == "dp" else 1)
        window = loader_batch * env.world_size * cfg.trainer.grad_accum_steps
        self.sampler, self.loader = train_loader(
            self.train_set, self.encoder, data, loader_batch, window, env.world_size, env.rank, cfg.seed, self.device
        )
        self.num_batches = math.ceil(self.sampler.num_samples / loader_batch)
        self.steps_per_epoch = math.ceil(self.num_batches / cfg.trainer.grad_accum_steps)
        trainer = cfg.trainer
        self.total_steps = trainer.max_steps if trainer.max_steps > 0 else trainer.max_epochs * self.steps_per_epoch

    def _setup_optimizer(self) -> None:
        self.lr = scaled_lr(self.cfg, self.num_devices)
        self.optimizer, self.scheduler, self.warmup_steps = build_optimizer(
            self.cfg.optimizer, self.model, self.lr, self.total_steps
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    def _resume_path(self) -> Path | None:
        resume = self.cfg.trainer.resume
        if resume == "never":
            return None
        return latest_checkpoint(self.output_dir) if resume == "auto" else Path(resume)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_AMP_DTYPES[self.precision])

    def evaluate(self) -> dict[str, float]:
        start = time.perf_counter()
        scorer = self.train_model if self.plan.strategy == "dp" else self.model  # DP: score on every GPU
        batch = self.cfg.data.eval_batch_size
        metrics = ev.evaluate(scorer, self.encoder, self.dev_pairs, batch, self.device, self.env, self.autocast)
        self.eval_time_s += time.perf_counter() - start
        return metrics

    # ----------------------------------------------------------------------------------------------- train
    def fit(self) -> dict:
        cfg, env = self.cfg, self.env
        progress = self._restore() if self.resume_from else {"step": 0, "epoch": 0, "batch": 0, "summary": {}}
        step, epoch, next_batch, summary = progress["step"], progress["epoch"], progress["batch"], progress["summary"]
        evaluated_at = progress.get("evaluated_at", -1)
        if step == 0 and cfg.trainer.evaluate:
            summary.update(ev.reference_metrics(self.dev_pairs) if env.is_main else {})
            if cfg.trainer.eval_before_training:
                initial = self._eval_and_log(0)
                summary.update({f"initial_{k}": v for k, v in initial.items()}, **initial)
                evaluated_at = 0

        accum, batch = cfg.trainer.grad_accum_steps, self.loader.batch_size
        timer = StepTimer(step, self.total_steps)
        losses: list[float] = []
        distill_losses: list[float] = []
        show = env.is_main and cfg.trainer.progress_bar and sys.stderr.isatty()
        bar = tqdm(total=self.total_steps, initial=step, desc="train", dynamic_ncols=True, disable=not show)
        self.train_model.train()
        train_start, eval_time_before = time.perf_counter(), self.eval_time_s
        while step < self.total_steps and not self.stopped:
            self.sampler.set_epoch(epoch)
            self.sampler.start = next_batch * batch
            self.train_set.set_epoch(epoch)
            batches = iter(self.loader)
            for first in range(next_batch, self.num_batches, accum):
                micro_steps = min(accum, self.num_batches - first)
                start = time.perf_counter()
                stats, wait, busy = self._accumulate(batches, first, micro_steps)
                loss_sum, tokens, queries, distill_sum, padded = stats.tolist()  # one device-to-host copy per step
                loss = loss_sum / queries
                if not math.isfinite(loss):
                    raise TrainingDiverged(
                        f"loss is {loss} at step {step + 1} (lr {self.lr:.3g}); lower "
                        "optimizer.lr or use trainer.precision=bf16/fp32"
                    )
                grad_norm = optimizer_step(self.model, self.optimizer, self.scheduler, self.scaler, cfg.optimizer)
                step += 1
                if self.after_step:
                    self.after_step(step)
                elapsed = time.perf_counter() - start
                timer.add(step, elapsed, wait, busy, queries, tokens, padded)
                losses.append(loss)
                distill_losses.append(distill_sum / queries)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{queries / elapsed:.1f}")
                if step % cfg.trainer.log_every == 0 or step == self.total_steps:
                    summary["train_loss"] = sum(losses) / len(losses)
                    if cfg.loss.distill_weight > 0:
                        summary["train_distill_loss"] = sum(distill_losses) / len(distill_losses)
                    distill_losses.clear()
                    lr = self.scheduler.get_last_lr()[0]
                    row = (summary["train_loss"], lr, grad_norm, queries, tokens, elapsed, wait)
                    log_train_step(self.logger, env.is_main, step, self.total_steps, epoch, *row)
                    losses.clear()
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                    summary.update(self._eval_and_log(step))
                    evaluated_at = step
                done = first + micro_steps
                position = (epoch, done) if done < self.num_batches else (epoch + 1, 0)
                if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                    self._checkpoint(step, position, summary, evaluated_at)
                if stop_requested(self.output_dir, env):  # preemption: checkpoint now, the requeued job resumes
                    self._checkpoint(step, position, summary, evaluated_at)
                    bar.close()
                    return {**summary, "steps": step, "preempted_at_step": step}
                if step >= self.total_steps or self.stopped:
                    break
            epoch, next_batch = epoch + 1, 0
            if evaluated_at != step and not self.stopped:
                summary.update(self._eval_and_log(step))
                evaluated_at = step
        bar.close()
        train_time = time.perf_counter() - train_start - (self.eval_time_s - eval_time_before)
        throughput = summarize(env.gather_objects(timer.rank_record(self.device)))
        summary.update(self.facts, **throughput, steps=step, epochs=epoch, stopped_early=self.stopped)
        summary.update(train_time_s=train_time, eval_time_s=self.eval_time_s)
        summary.update(speedup_facts(summary["train_samples_per_s"], cfg.speedup.baseline_samples_per_s, self.plan))
        if env.is_main:
            log_hints(summary, cfg.data.num_workers)
        self.logger.log_summary({**summary, "peak_memory_mb": max(summary["peak_memory_mb_per_rank"])})
        return summary

    def _accumulate(self, batches, first: int, micro_steps: int) -> tuple[torch.Tensor, float, float]:
        """Forward and backward over one accumulation window; returns the all-reduced (loss sum, tokens,
        queries, distillation term sum, token slots computed, padding included) and this rank's data-wait and
        busy seconds."""
        env = self.env
        batch, local_queries = self.loader.batch_size, self.sampler.num_samples
        # Queries in this window on each rank (the epoch's last batch may be short): the loss is a mean over
        # the whole window, so accumulation and sharding give the gradient of one big batch.
        window_queries = min(local_queries, (first + micro_steps) * batch) - first * batch
        wait = busy = 0.0
        stats = torch.zeros(5, dtype=torch.float64, device=self.device)  # NCCL reduces CUDA tensors only
        for micro in range(micro_steps):
            fetched = time.perf_counter()
            inputs = next(batches)
            computed = time.perf_counter()
            wait += computed - fetched
            # DDP all-reduces gradients on the window's last backward only
            sync = micro == micro_steps - 1 or not env.distributed
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            # planned on the host copy of the mask: no device sync
            chunks = length_chunks(mask.sum(-1).tolist(), self.cfg.trainer.forward_chunks)
            with contextlib.nullcontext() if sync else self.train_model.no_sync(), self.autocast():
                logits = self.train_model(
                    ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True), chunks=chunks
                )
                per_query, distill = self.loss_fn(logits, inputs.get("teacher_scores"))
            busy += time.perf_counter() - computed
            self.scaler.scale(per_query.sum() / window_queries).backward()
            distill_sum = distill.detach().sum() if distill is not None else torch.zeros(())
            loss_sum, tokens, queries = per_query.detach().sum(), mask.sum(), torch.tensor(len(per_query))
            values = (loss_sum, tokens, queries, distill_sum, torch.tensor(padded_slots(chunks)))
            stats += torch.stack([value.to(stats) for value in values])
        return env.all_reduce_sum(stats), wait, busy + wait

    def _eval_and_log(self, step: int) -> dict[str, float]:
        if not self.cfg.trainer.evaluate:
            return {}
        metrics = self.evaluate()
        log_eval(self.logger, self.env.is_main, metrics, step)
        # Callbacks decide on the main rank; every rank must then stop at the same step, or DDP would hang.
        votes = [callback(step, metrics) for callback in self.eval_callbacks] if self.env.is_main else []  # all run
        stop = any(votes)
        stop = stop and step < self.total_steps  # a run that trained to the end is complete, never pruned
        self.stopped = self.env.gather_objects(stop)[0]
        if self.stopped and self.env.is_main:
            log.info("stopping after the evaluation at step %d (an evaluation callback asked to)", step)
        return metrics

    # ------------------------------------------------------------------------------------------ checkpoint
    def _checkpoint(self, step: int, position: tuple[int, int], summary: dict, evaluated_at: int) -> None:
        progress = {"step": step, "epoch": position[0], "batch": position[1]}
        progress.update(evaluated_at=evaluated_at, summary=summary)
        parts = (self.model, self.optimizer, self.scheduler, self.scaler, self.env)
        path = save_training_state(self.output_dir, *parts, progress, self.cfg.trainer.keep_checkpoints)
        if path:
            log.info("checkpoint: %s", path)

    def _restore(self) -> dict:
        parts = (self.model, self.optimizer, self.scheduler, self.scaler, self.env)
        progress = restore_training_state(self.resume_from, *parts)
        if self.env.is_main:
            where = (progress[key] for key in ("path", "step", "epoch", "batch"))
            log.info("resumed from %s at step %d (epoch %d, batch %d)", *where)
        self.logger.truncate(progress["step"])
        return progress

    # ------------------------------------------------------------------------------------------------ save
    def save(self) -> None:
        if self.env.is_main and self.cfg.trainer.save_model:
            save_reranker(self.model, self.tokenizer, self.cfg.model, self.output_dir / "model")

    def cleanup(self) -> None:
        self.logger.finish()


def run_training(
    cfg: RunConfig, env: DistEnv, plan: DevicePlan, output_dir: Path, inputs: RunInputs | None = None
) -> dict:
    """setup -> fit -> save -> cleanup on this rank; every rank returns the same metrics."""
    callbacks = []
    if cfg.trial.storage and env.is_main:
        from lychee_exp.sweep.pruning import pruning_callback  # optuna is only needed by sweeps

        callbacks.append(pruning_callback(cfg.trial, cfg.optimized_metric))
    trainer = Trainer(cfg, env, plan, output_dir, callbacks, inputs)
    try:
        trainer.setup()
        metrics = trainer.fit()
        if "preempted_at_step" not in metrics:
            trainer.save()
    finally:
        if hasattr(trainer, "logger"):
            trainer.cleanup()
    return metrics
