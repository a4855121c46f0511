"""The training recipe: setup -> fit (train with periodic dev evaluation) -> save, on one rank of a run.

Every rank runs this same code; only the main rank logs, shows progress and saves. A step is one optimizer
update over `grad_accum_steps` micro-batches of `data.batch_size` queries on each of `world_size` devices.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import random
import resource
import signal
import sys
import time
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm
from transformers import get_scheduler

from lychee_exp import evaluate as ev
from lychee_exp.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from lychee_exp.config import RunConfig
from lychee_exp.data import GroupCollator, TrainGroups, build_dev_pairs, load_queries
from lychee_exp.devices import DevicePlan
from lychee_exp.distributed import DistEnv, device_name
from lychee_exp.loggers import make_logger
from lychee_exp.losses import LOSSES
from lychee_exp.model import build_encoder, count_parameters, load_reranker, load_tokenizer, save_reranker

log = logging.getLogger(__name__)

TIMING_WARMUP_STEPS = 2  # the first steps pay for allocator and kernel warm-up; throughput skips them
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf."""


DATA_WAIT_HINT = 0.2  # share of step time spent waiting for batches that earns a hint
RANK_SPREAD_HINT = 1.25  # slowest / fastest rank compute time that earns a hint


def effective_batch_size(cfg: RunConfig, num_devices: int) -> int:
    """Queries per optimizer step: per-device batch x devices x accumulation."""
    return cfg.data.batch_size * num_devices * cfg.trainer.grad_accum_steps


def scaled_lr(cfg: RunConfig, num_devices: int) -> float:
    """The multi-GPU guide's rule: keep lr per sample constant as the effective batch grows (linear) or
    grow it with the square root (sqrt, gentler for Adam)."""
    ratio = effective_batch_size(cfg, num_devices) / cfg.optimizer.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.optimizer.lr_scaling]
    return cfg.optimizer.lr * factor


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch (resume) without touching the batches it skips."""

    start = 0  # items of this rank's shard to skip in the current epoch

    def __iter__(self):
        return islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


class Trainer:
    def __init__(self, cfg: RunConfig, env: DistEnv, plan: DevicePlan, output_dir: Path):
        self.cfg, self.env, self.plan, self.output_dir = cfg, env, plan, output_dir
        self.device = env.device
        self.num_devices = plan.num_devices  # devices whose batches make one step (DDP ranks or DP GPUs)

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg, env = self.cfg, self.env
        seed_everything(cfg.seed, cfg.trainer.deterministic)
        self.tokenizer = load_tokenizer(cfg.model)
        self.encoder = build_encoder(cfg.model, self.tokenizer)
        self.model = load_reranker(cfg.model, self.encoder, cfg.seed).to(self.device)
        self.params_total, self.params_trainable = count_parameters(self.model)

        instruction = cfg.data.instruction or cfg.model.prompt.default_instruction
        train_queries = load_queries(cfg.data.train_file, "data.train_file", cfg.data.max_train_queries)
        dev_queries = load_queries(cfg.data.dev_file, "data.dev_file", cfg.data.max_dev_queries)
        self.train_set = TrainGroups(train_queries, cfg.data.train_group_size, instruction, cfg.seed)
        self.dev_pairs = build_dev_pairs(dev_queries, self.encoder, instruction, cfg.seed)
        # One sampler for every world size: its permutation depends on (seed, epoch) only, and rank r takes
        # items r, r + world, ..., so a run on N ranks sees the same global batches as one process.
        # drop_last: each query at most once per epoch, and every rank has the same number of batches.
        self.sampler = ResumableSampler(self.train_set, num_replicas=env.world_size, rank=env.rank,
                                        shuffle=True, seed=cfg.seed, drop_last=True)
        if self.sampler.num_samples == 0:
            raise ValueError(f"{len(self.train_set)} training queries cannot be split over {env.world_size} ranks")
        # DataParallel splits one process's batch over its GPUs, so that process loads all of their batches.
        loader_batch = cfg.data.batch_size * (self.num_devices if self.plan.strategy == "dp" else 1)
        self.loader = DataLoader(self.train_set, batch_size=loader_batch, sampler=self.sampler,
                                 collate_fn=GroupCollator(self.encoder), num_workers=cfg.data.num_workers,
                                 pin_memory=self.device.type == "cuda", persistent_workers=cfg.data.num_workers > 0)

        accum = cfg.trainer.grad_accum_steps
        self.steps_per_epoch = math.ceil(math.ceil(self.sampler.num_samples / loader_batch) / accum)
        self.total_steps = (cfg.trainer.max_steps if cfg.trainer.max_steps > 0
                            else cfg.trainer.max_epochs * self.steps_per_epoch)
        self.lr = scaled_lr(cfg, self.num_devices)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.lr, betas=tuple(cfg.optimizer.betas),
                                           eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay)
        schedule = {"constant": "constant_with_warmup"}.get(cfg.optimizer.scheduler, cfg.optimizer.scheduler)
        self.warmup_steps = math.ceil(cfg.optimizer.warmup_ratio * self.total_steps)
        self.scheduler = get_scheduler(schedule, self.optimizer, num_warmup_steps=self.warmup_steps,
                                       num_training_steps=self.total_steps)
        self.precision = resolve_precision(cfg.trainer.precision, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.loss_fn = LOSSES[cfg.loss.name]
        self.train_model = self._wrap(self.model)
        self.resume_from = self._resume_path()
        self.logger = make_logger(cfg.logger.name, self.output_dir, env.is_main)
        self.eval_time_s = 0.0
        self._describe()

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.env.distributed:
            # No buffer here changes in training; syncing buffers would make every forward a synchronisation
            # point (and hide which rank is slow). torch >= 2.13 names the switch forward_sync_buffers.
            params = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
            no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
            return torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=self.cfg.parallel.find_unused_parameters, **no_sync)
        if self.plan.strategy == "dp" and self.num_devices > 1:
            return torch.nn.DataParallel(model, device_ids=list(range(self.num_devices)))
        return model

    def _resume_path(self) -> Path | None:
        resume = self.cfg.trainer.resume
        if resume == "never":
            return None
        if resume == "auto":
            return latest_checkpoint(self.output_dir)
        return Path(resume)

    def _describe(self) -> None:
        if not self.env.is_main:
            return
        cfg = self.cfg
        log.info("model %s (%s): %.1fM parameters, %.2fM trainable", cfg.model.name, cfg.model.kind,
                 self.params_total / 1e6, self.params_trainable / 1e6)
        log.info("data: %d train queries, %d dev queries (%d pairs); device %s x %d, precision %s",
                 len(self.train_set), len(set(self.dev_pairs.query_index)), len(self.dev_pairs.labels),
                 device_name(self.device), self.num_devices, self.precision)
        log.info("effective batch %d queries (%d per device x %d devices x %d accumulation); lr %.3g "
                 "(base %.3g at batch %d, scaling %s); %d steps (%d per epoch), warmup %d",
                 effective_batch_size(cfg, self.num_devices), cfg.data.batch_size, self.num_devices,
                 cfg.trainer.grad_accum_steps, self.lr, cfg.optimizer.lr, cfg.optimizer.base_batch_size,
                 cfg.optimizer.lr_scaling, self.total_steps, self.steps_per_epoch, self.warmup_steps)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_AMP_DTYPES[self.precision])

    def evaluate(self) -> dict[str, float]:
        start = time.perf_counter()
        scorer = self.train_model if self.plan.strategy == "dp" else self.model  # DP: score on every GPU
        metrics = ev.evaluate(scorer, self.encoder, self.dev_pairs, self.cfg.data.eval_batch_size, self.device,
                              self.env.rank, self.env.world_size, self.env.gather_objects, self.autocast)
        self.eval_time_s += time.perf_counter() - start
        return metrics

    # ----------------------------------------------------------------------------------------------- train
    def fit(self) -> dict:
        cfg, env = self.cfg, self.env
        progress = self._restore() if self.resume_from else {"step": 0, "epoch": 0, "batch": 0, "summary": {}}
        step, epoch, next_batch, summary = progress["step"], progress["epoch"], progress["batch"], progress["summary"]
        if step == 0:
            summary.update(self._baselines())
        evaluated_at = progress.get("evaluated_at", -1)
        if step == 0 and cfg.trainer.eval_before_training:
            initial = self._eval_and_log(0)
            summary.update({f"initial_{k}": v for k, v in initial.items()}, **initial)
            evaluated_at = 0

        accum, batch = cfg.trainer.grad_accum_steps, self.loader.batch_size
        local_queries = self.sampler.num_samples
        num_batches = math.ceil(local_queries / batch)
        timed = {"time": 0.0, "wait": 0.0, "busy": 0.0, "queries": 0.0, "tokens": 0.0}
        window_loss, window_count, timed_from = 0.0, 0, step + TIMING_WARMUP_STEPS
        bar = tqdm(total=self.total_steps, initial=step, desc="train", dynamic_ncols=True,
                   disable=not (env.is_main and cfg.trainer.progress_bar and sys.stderr.isatty()))
        self.train_model.train()
        train_start = time.perf_counter()
        while step < self.total_steps:
            self.sampler.set_epoch(epoch)
            self.sampler.start = next_batch * batch
            self.train_set.set_epoch(epoch)
            batches = iter(self.loader)
            for first in range(next_batch, num_batches, accum):
                micro_steps = min(accum, num_batches - first)
                # Queries in this window on each rank (the epoch's last batch may be short): the loss is a mean
                # over the whole window, so accumulation and sharding give the gradient of one big batch.
                window_queries = min(local_queries, (first + micro_steps) * batch) - first * batch
                start = time.perf_counter()
                wait = busy = 0.0
                stats = torch.zeros(3, dtype=torch.float64)  # loss sum, tokens, queries
                for micro in range(micro_steps):
                    fetched = time.perf_counter()
                    inputs = next(batches)
                    wait += time.perf_counter() - fetched
                    sync = micro == micro_steps - 1 or not env.distributed
                    computed = time.perf_counter()
                    with contextlib.nullcontext() if sync else self.train_model.no_sync(), self.autocast():
                        logits = self.train_model(inputs["input_ids"].to(self.device, non_blocking=True),
                                                  inputs["attention_mask"].to(self.device, non_blocking=True))
                        per_query = self.loss_fn(logits, cfg.data.train_group_size, cfg.loss.temperature)
                    busy += time.perf_counter() - computed  # forward only: backward waits on other ranks
                    self.scaler.scale(per_query.sum() / window_queries).backward()
                    stats += torch.tensor([per_query.detach().sum().item(), inputs["attention_mask"].sum().item(),
                                           len(per_query)], dtype=torch.float64)
                stats = env.all_reduce_sum(stats)
                loss = stats[0].item() / stats[2].item()
                if not math.isfinite(loss):
                    raise TrainingDiverged(f"loss is {loss} at step {step + 1} (lr {self.lr:.3g}); lower "
                                           "optimizer.lr or use trainer.precision=bf16/fp32")
                grad_norm = self._optimizer_step()
                step += 1
                self._inject_fault(step)
                elapsed = time.perf_counter() - start
                if step > timed_from or self.total_steps - progress["step"] <= TIMING_WARMUP_STEPS:
                    for key, value in (("time", elapsed), ("wait", wait), ("busy", busy + wait),
                                       ("queries", stats[2].item()), ("tokens", stats[1].item())):
                        timed[key] += value
                window_loss, window_count = window_loss + loss, window_count + 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{stats[2].item() / elapsed:.1f}")
                if step % cfg.trainer.log_every == 0 or step == self.total_steps:
                    summary["train_loss"] = window_loss / window_count
                    self._log_train(step, epoch, summary["train_loss"], grad_norm, stats, elapsed, wait)
                    window_loss, window_count = 0.0, 0
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                    summary.update(self._eval_and_log(step))
                    evaluated_at = step
                position = (epoch, first + micro_steps) if first + micro_steps < num_batches else (epoch + 1, 0)
                if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                    self._checkpoint(step, position, summary, evaluated_at)
                if step >= self.total_steps:
                    break
            epoch, next_batch = epoch + 1, 0
            if evaluated_at != step:
                summary.update(self._eval_and_log(step))
                evaluated_at = step
        bar.close()
        train_time = time.perf_counter() - train_start - self.eval_time_s
        summary.update(self._run_facts(step, epoch, train_time, timed))
        return summary

    def _inject_fault(self, step: int) -> None:
        """Test hook for failure handling: LYCHEE_FAULT=<rank>:<step>:<raise|kill|hang>."""
        fault = os.environ.get("LYCHEE_FAULT")
        if not fault:
            return
        rank, at_step, action = fault.split(":")
        if int(rank) != self.env.rank or int(at_step) != step:
            return
        if action == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hang":
            time.sleep(3600)

    def _baselines(self) -> dict[str, float]:
        if not self.env.is_main:
            return {}
        bm25 = ev.ranking_metrics(ev.bm25_scores(self.dev_pairs), self.dev_pairs.labels,
                                  self.dev_pairs.query_index, prefix="bm25_")
        log.info("BM25 on the dev candidates: ndcg@10 %.4f, mrr@10 %.4f", bm25["bm25_ndcg@10"], bm25["bm25_mrr@10"])
        return bm25

    def _log_train(self, step: int, epoch: int, loss: float, grad_norm: float, stats: torch.Tensor,
                   elapsed: float, wait: float) -> None:
        lr = self.scheduler.get_last_lr()[0]
        samples_per_s, tokens_per_s = stats[2].item() / elapsed, stats[1].item() / elapsed
        self.logger.log_metrics({"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                                 "train/samples_per_s": samples_per_s, "train/tokens_per_s": tokens_per_s,
                                 "train/data_wait_share": wait / elapsed, "epoch": epoch}, step)
        if self.env.is_main:
            log.info("step %d/%d | loss %.4f | lr %.3g | %.1f samples/s | %.0f tokens/s | data wait %.0f%%",
                     step, self.total_steps, loss, lr, samples_per_s, tokens_per_s, 100 * wait / elapsed)

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
        metrics = self.evaluate()
        self._log_eval(metrics, step)
        return metrics

    def _log_eval(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics({f"dev/{k}": v for k, v in metrics.items()}, step)
        if self.env.is_main:
            log.info("step %d: dev %s", step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def _run_facts(self, steps: int, epochs: int, train_time: float, timed: dict) -> dict:
        cfg, env = self.cfg, self.env
        per_rank = env.gather_objects({"busy": timed["busy"], "wait": timed["wait"], "time": timed["time"],
                                       "peak_memory_mb": peak_memory_mb(self.device)})
        busy = [r["busy"] for r in per_rank]
        facts = {
            "steps": steps,
            "epochs": epochs,
            "effective_batch_size": effective_batch_size(cfg, self.num_devices),
            "per_device_batch_size": cfg.data.batch_size,
            "world_size": self.num_devices,
            "num_processes": env.world_size,
            "strategy": self.plan.strategy,
            "grad_accum_steps": cfg.trainer.grad_accum_steps,
            "train_group_size": cfg.data.train_group_size,
            "lr": self.lr,
            "base_lr": cfg.optimizer.lr,
            "precision": self.precision,
            "device": device_name(self.device),
            "device_type": self.device.type,
            "train_samples_per_s": timed["queries"] / timed["time"] if timed["time"] else 0.0,
            "train_tokens_per_s": timed["tokens"] / timed["time"] if timed["time"] else 0.0,
            # mean over ranks of the share of step time spent waiting for the next batch
            "data_wait_share": sum(r["wait"] / r["time"] if r["time"] else 0.0 for r in per_rank) / len(per_rank),
            # slowest / fastest rank, on time spent without collectives (data wait + forward)
            "rank_time_spread": max(busy) / min(busy) if min(busy) > 0 else 1.0,
            "peak_memory_mb_per_rank": [r["peak_memory_mb"] for r in per_rank],
            "train_time_s": train_time,
            "eval_time_s": self.eval_time_s,
            "parameters": self.params_total,
            "trainable_parameters": self.params_trainable,
        }
        if env.is_main:
            self._hint(facts)
        return facts

    def _hint(self, facts: dict) -> None:
        if facts["data_wait_share"] > DATA_WAIT_HINT:
            log.warning("data loading: %.0f%% of step time waits for batches; raise data.num_workers (now %d)",
                        100 * facts["data_wait_share"], self.cfg.data.num_workers)
        if facts["rank_time_spread"] > RANK_SPREAD_HINT:
            log.warning("uneven ranks: the slowest takes %.2fx the fastest; check other jobs on those devices, "
                        "CPU threads per rank, or length-skewed batches", facts["rank_time_spread"])

    # ------------------------------------------------------------------------------------------ checkpoint
    def _checkpoint(self, step: int, position: tuple[int, int], summary: dict, evaluated_at: int) -> None:
        rngs = self.env.gather_objects(rng_state())  # every rank's, so dropout continues as it would have
        if not self.env.is_main:
            return
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "scaler": self.scaler.state_dict(), "step": step, "epoch": position[0], "batch": position[1],
                 "evaluated_at": evaluated_at, "summary": json.dumps(summary), "rng": rngs,
                 "world_size": self.env.world_size}
        path = save_checkpoint(self.output_dir, step, self.model, state, self.cfg.trainer.keep_checkpoints)
        log.info("checkpoint: %s", path)

    def _restore(self) -> dict:
        state = load_checkpoint(self.resume_from, self.model)
        if state["world_size"] != self.env.world_size:
            raise ValueError(f"checkpoint {self.resume_from} was written by {state['world_size']} ranks, "
                             f"this run has {self.env.world_size}; resume with the same gpus")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"][self.env.rank])
        if self.env.is_main:
            log.info("resumed from %s at step %d (epoch %d, batch %d)", self.resume_from, state["step"],
                     state["epoch"], state["batch"])
        self.logger.truncate(state["step"])
        return {"step": state["step"], "epoch": state["epoch"], "batch": state["batch"],
                "evaluated_at": state["evaluated_at"], "summary": json.loads(state["summary"])}

    # ------------------------------------------------------------------------------------------------ save
    def save(self) -> None:
        if self.env.is_main and self.cfg.trainer.save_model:
            save_reranker(self.model, self.tokenizer, self.cfg.model, self.output_dir / "model")

    def cleanup(self) -> None:
        self.logger.finish()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_training(cfg: RunConfig, env: DistEnv, plan: DevicePlan, output_dir: Path) -> dict:
    """setup -> fit -> save -> cleanup on this rank; every rank returns the same metrics."""
    trainer = Trainer(cfg, env, plan, output_dir)
    try:
        trainer.setup()
        metrics = trainer.fit()
        trainer.save()
    finally:
        if hasattr(trainer, "logger"):
            trainer.cleanup()
    return metrics
