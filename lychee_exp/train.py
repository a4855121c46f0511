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
from torch.utils.data import DataLoader
from tqdm import tqdm

from lychee_exp import evaluate as ev
from lychee_exp.bucketing import train_sampler
from lychee_exp.checkpoint import latest_checkpoint, restore_training_state, save_training_state
from lychee_exp.config import RunConfig
from lychee_exp.data import GroupCollator, TrainGroups, build_dev_pairs
from lychee_exp.devices import DevicePlan, resolve_precision
from lychee_exp.distributed import DistEnv, wrap_for_training
from lychee_exp.errors import TrainingDiverged
from lychee_exp.faults import fault_hook
from lychee_exp.inputs import RunInputs, load_inputs
from lychee_exp.loggers import log_eval, log_setup, log_train_step, run_logger
from lychee_exp.losses import build_loss
from lychee_exp.model import count_parameters, load_reranker, save_reranker
from lychee_exp.optim import build_optimizer, scaled_lr
from lychee_exp.preemption import stop_requested
from lychee_exp.speedup import baseline_description
from lychee_exp.throughput import StepTimer, log_hints, setup_facts, speedup_facts, summarize

log = logging.getLogger(__name__)

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


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
        self.after_step = fault_hook(self.env.rank)  # None outside failure-handling tests
        self.resume_from = self._resume_path()
        self.facts = setup_facts(cfg, self.env, self.plan, self.lr, self.precision, count_parameters(self.model))
        self.logger = run_logger(cfg, self.output_dir, self.env.is_main, self.facts)
        self.eval_time_s = 0.0
        self.stopped = False  # set when an evaluation callback (e.g. a sweep's pruner) ends the run early
        if self.env.is_main:
            log_setup(
                cfg,
                self.facts,
                len(self.train_set),
                self.dev_pairs,
                self.total_steps,
                self.steps_per_epoch,
                self.warmup_steps,
            )

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
        # One sampler for every world size: its permutation depends on (seed, epoch) only, and rank r takes
        # items r, r + world, ..., so a run on N ranks sees the same global batches as one process.
        # drop_last: each query at most once per epoch, and every rank has the same number of batches.
        # DataParallel splits one process's batch over its GPUs, so that process loads all of their batches.
        loader_batch = data.batch_size * (self.num_devices if self.plan.strategy == "dp" else 1)
        self.sampler = train_sampler(
            self.train_set,
            self.encoder,
            data.bucket_by_length,
            data.bucket_pool_batches,
            loader_batch * env.world_size * cfg.trainer.grad_accum_steps,
            env.world_size,
            env.rank,
            cfg.seed,
        )
        if self.sampler.num_samples == 0:
            raise ValueError(f"{len(self.train_set)} training queries cannot be split over {env.world_size} ranks")
        self.loader = DataLoader(
            self.train_set,
            batch_size=loader_batch,
            sampler=self.sampler,
            collate_fn=GroupCollator(self.encoder),
            num_workers=data.num_workers,
            # not persistent: workers must see set_epoch's resampled negatives
            pin_memory=self.device.type == "cuda",
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
        metrics = ev.evaluate(
            scorer,
            self.encoder,
            self.dev_pairs,
            self.cfg.data.eval_batch_size,
            self.device,
            self.env.rank,
            self.env.world_size,
            self.env.gather_objects,
            self.autocast,
        )
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
        bar = tqdm(
            total=self.total_steps,
            initial=step,
            desc="train",
            dynamic_ncols=True,
            disable=not (env.is_main and cfg.trainer.progress_bar and sys.stderr.isatty()),
        )
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
                grad_norm = self._optimizer_step()
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
                    log_train_step(
                        self.logger,
                        env.is_main,
                        step,
                        self.total_steps,
                        epoch,
                        summary["train_loss"],
                        self.scheduler.get_last_lr()[0],
                        grad_norm,
                        queries,
                        tokens,
                        elapsed,
                        wait,
                    )
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
        summary.update(
            self.facts,
            steps=step,
            epochs=epoch,
            train_time_s=train_time,
            eval_time_s=self.eval_time_s,
            stopped_early=self.stopped,
            **throughput,
        )
        summary.update(
            speedup_facts(
                summary["train_samples_per_s"],
                cfg.speedup.baseline_samples_per_s,
                self.num_devices,
                baseline_description(self.plan),
            )
        )
        if env.is_main:
            log_hints(summary, cfg.data.num_workers)
        self.logger.log_summary({**summary, "peak_memory_mb": max(summary["peak_memory_mb_per_rank"])})
        return summary

    def _accumulate(self, batches, first: int, micro_steps: int) -> tuple[torch.Tensor, float, float]:
        """Forward and backward over one accumulation window; returns the all-reduced (loss sum, tokens,
        queries, distillation term sum, batch slots with padding) and this rank's data-wait and busy seconds."""
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
            with contextlib.nullcontext() if sync else self.train_model.no_sync(), self.autocast():
                logits = self.train_model(
                    inputs["input_ids"].to(self.device, non_blocking=True),
                    inputs["attention_mask"].to(self.device, non_blocking=True),
                )
                per_query, distill = self.loss_fn(logits, inputs.get("teacher_scores"))
            busy += time.perf_counter() - computed
            self.scaler.scale(per_query.sum() / window_queries).backward()
            stats += torch.stack(
                [
                    per_query.detach().sum().double(),
                    inputs["attention_mask"].sum().to(stats),
                    torch.tensor(len(per_query)).to(stats),
                    (distill.detach().sum() if distill is not None else torch.zeros(())).to(stats),
                    torch.tensor(inputs["attention_mask"].numel()).to(stats),
                ]
            )
        return env.all_reduce_sum(stats), wait, busy + wait

    def _optimizer_step(self) -> float:
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.optimizer.max_grad_norm or float("inf")
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

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
        progress = {
            "step": step,
            "epoch": position[0],
            "batch": position[1],
            "evaluated_at": evaluated_at,
            "summary": summary,
        }
        path = save_training_state(
            self.output_dir,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.env,
            progress,
            self.cfg.trainer.keep_checkpoints,
        )
        if path:
            log.info("checkpoint: %s", path)

    def _restore(self) -> dict:
        progress = restore_training_state(
            self.resume_from, self.model, self.optimizer, self.scheduler, self.scaler, self.env
        )
        if self.env.is_main:
            log.info(
                "resumed from %s at step %d (epoch %d, batch %d)",
                progress["path"],
                progress["step"],
                progress["epoch"],
                progress["batch"],
            )
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
