"""The training recipe: setup -> fit (train with periodic dev evaluation) -> save -> cleanup, on one rank of a run
(train_on_rank: what a rank calls, with a sweep trial's pruning callback), and what that rank trains on and for how
long (TrainData: the training groups, the dev pairs, the DataLoader and its schedule).

Every rank runs this same code; only the main rank logs, shows progress and saves. A step is one optimizer
update over `grad_accum_steps` micro-batches of `data.batch_size` queries on each of `num_devices` devices.
The parts (model, data, loss, optimizer, logger) come from the library (lychee_exp) and tracking modules
named for them; what happens around a step (preemption, injected faults) comes from the caller as StepHooks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from lychee_exp.config.auto import forward_chunk_count, packing_on, scaled_lr
from lychee_exp.config.schema import RunConfig
from lychee_exp.data.groups import DevPairs, TrainGroups
from lychee_exp.data.loader import train_loader
from lychee_exp.data.token_cache import pretokenized
from lychee_exp.io.progress import progress_meter, row_eta
from lychee_exp.ir import evaluate as ev
from lychee_exp.ir.metrics import named_figure
from lychee_exp.model.model_card import counted
from lychee_exp.model.packed import packed_attention_path_of
from lychee_exp.model.precision import resolve_precision
from lychee_exp.model.reranker import apply_levers, count_parameters, load_reranker
from lychee_exp.parallel.devices import DevicePlan
from lychee_exp.parallel.distributed import DistEnv, seed_everything, wrap_for_training
from lychee_exp.parallel.memory_plan import resolved_model_config
from lychee_exp.tracking.backends import NullLogger, run_logger
from lychee_exp.tracking.console import log_eval, log_setup, log_train_step
from lychee_exp.tracking.memory import release_freed_memory
from lychee_exp.tracking.phases import PEAKS, handed_down, phase, rank_figures
from lychee_exp.tracking.throughput import StepTimer, gpu_memory, log_hints, setup_facts, summarize
from lychee_exp.tracking.trial import current_trial, pruning_callback
from lychee_exp.train.baseline_phase import one_device_baseline, run_speedup
from lychee_exp.train.best import Best, best_figures, observe, patience_spent
from lychee_exp.train.checkpoint import (
    TrainingState,
    load_step_weights,
    restore_training_state,
    resume_path,
    rewrite_model_card,
    save_model,
    save_training_state,
    step_dir,
)
from lychee_exp.train.checkpoint_schedule import CheckpointSchedule, measured_interval
from lychee_exp.train.inputs import RunInputs, load_inputs
from lychee_exp.train.losses import build_loss
from lychee_exp.train.optim import build_optimizer, optimizer_step
from lychee_exp.train.progress import NO_HOOKS, NOTHING_LEFT, PendingSteps, Progress, StepFigures, StepHooks
from lychee_exp.train.step import WindowStep

log = logging.getLogger(__name__)


class Trainer:
    """One rank's training run: `setup()` builds the model, data, optimizer, loss and logger; `fit()` trains with
    periodic dev evaluation, checkpoints, early stopping and the caller's step hooks, ends with the best
    evaluation's weights where trainer.load_best_model_at_end asks (train.best), and returns the run's metrics (the
    same on every rank); `save()` writes the model (main rank); `cleanup()` closes the logger. The trained model
    is saved (and the last step checkpointed) before the final dev evaluation, so that a run killed in that
    evaluation keeps its training; `save()` then adds the evaluation's figures to its card.

    Raises TrainingDiverged when a step's loss is not finite, torch.OutOfMemoryError when a batch does not fit,
    and whatever a step hook raises. A fit that a stop request ended returns with `preempted_at_step`."""

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        plan: DevicePlan,
        output_dir: Path,
        eval_callbacks: Sequence[Callable[[int, dict], bool]] = (),
        inputs: RunInputs | None = None,
        hooks: StepHooks = NO_HOOKS,
    ):
        self.cfg, self.env, self.plan, self.output_dir, self.hooks = cfg, env, plan, output_dir, hooks
        self.eval_callbacks = list(eval_callbacks)  # (step, dev metrics) -> True to stop; main rank only
        self.inputs = inputs  # read by this process's preflight already, else loaded in setup
        self.device = env.device
        self.num_devices = plan.num_devices  # devices whose batches make one step (DDP ranks or DP GPUs)
        # built by setup()
        self.tokenizer = self.encoder = self.model = self.train_model = self.precision = self.model_cfg = None
        self.data: TrainData | None = None
        self.lr, self.optimizer, self.scheduler, self.warmup_steps, self.scaler = 0.0, None, None, 0, None
        self.loss_fn = self.resume_from = self.step = self.baseline = None  # baseline: train.baseline_phase's
        self.forward_chunks, self.facts = 1, {}
        self.first_step = 0  # the step fit started from (a resumed run's checkpoint's)
        self.logger = NullLogger()
        # state of fit()
        self.eval_time_s = self.eval_cpu_s = 0.0
        # checkpoint writes, off the training clock as evaluations are: a 23-step run's two writes were 5% of its
        # timed window, which the peers it is compared with (and its own one-device baseline) never pay
        self.checkpoint_time_s = self.checkpoint_cpu_s = 0.0
        self.logged: list[StepFigures] = []  # steps read since the last logged training row
        self.pending = PendingSteps()  # steps whose figures are still on the device
        self.timer: StepTimer | None = None
        self.bar: tqdm | None = None
        self.stopped = False  # set when an evaluation callback (e.g. a sweep's pruner) ends the run early
        self.stop_reason: str | None = None  # pruned (an evaluation callback) or early_stopping
        self.best_metric = str(cfg.trainer.metric_for_best_model or cfg.optimized_metric)  # ranks evaluations
        self.checkpointed_at = -1  # the step of this process's newest checkpoint
        self.checkpoints: CheckpointSchedule | None = None  # which steps checkpoint (set by fit)
        self.since_checkpoint = (0, 0.0)  # the step and training clock of the last checkpoint (or the start)
        self.model_saved_at: int | None = None  # the step whose weights this process wrote to model/ (None: none)

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        packs = packing_on(self.cfg, self.device.type, self.plan.strategy)  # data.packing=auto decided here
        cfg = self.cfg = dataclasses.replace(self.cfg, data=dataclasses.replace(self.cfg.data, packing=packs))
        seed_everything(cfg.seed, cfg.trainer.deterministic)
        inputs = self.inputs or load_inputs(cfg, warn_unknown=False)  # the Hydra process warned already
        self._setup_model(inputs)
        self.data = build_train_data(cfg, self.env, self.plan, inputs)
        self.loss_fn = build_loss(cfg.loss, cfg.data.train_group_size)
        self._setup_optimizer()
        self.resume_from = resume_path(cfg.trainer.resume, self.output_dir)
        self.facts = setup_facts(cfg, self.env, self.plan, self.lr, self.precision, count_parameters(self.model))
        self.facts["forward_chunks"] = self.forward_chunks
        if cfg.data.max_tokens_per_batch:  # steps vary in size: the plan's mean (what the lr was scaled to)
            self.facts.update(
                effective_batch_size=self.data.schedule.mean_step_queries(),
                max_tokens_per_batch=cfg.data.max_tokens_per_batch,
            )
        self.logger = run_logger(cfg, self.output_dir, self.env.is_main, self.facts)
        if self.env.is_main:
            data = self.data
            steps = {"total_steps": data.total_steps, "steps_per_epoch": data.steps_per_epoch}
            log_setup(cfg, self.facts, len(data.train_set), data.dev_pairs, **steps, warmup_steps=self.warmup_steps)

    def _setup_model(self, inputs: RunInputs) -> None:
        self.tokenizer, self.encoder = inputs.tokenizer, inputs.encoder
        model_cfg = self.model_cfg = resolved_model_config(self.cfg, self.encoder, self.device)
        model = load_reranker(model_cfg, self.encoder, self.cfg.seed, packing=self.cfg.data.packing, training=True)
        self.model = model.to(self.device)
        self.precision = resolve_precision(self.cfg.trainer.precision, self.device)
        apply_levers(self.model, model_cfg, self.precision, self.device)
        self.attention = packed_attention_path_of(self.cfg, self.device, self.precision)  # stops without varlen
        self.train_model = wrap_for_training(self.model, self.env, self.plan, self.cfg.parallel, self.precision)

    def _setup_optimizer(self) -> None:
        self.lr = scaled_lr(self.cfg, self.num_devices, self.data.schedule.mean_step_queries())
        self.optimizer, self.scheduler, self.warmup_steps = build_optimizer(
            self.cfg.optimizer, self.model, self.lr, self.data.total_steps
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.forward_chunks = forward_chunk_count(self.cfg.trainer.forward_chunks, self.device.type, self.plan.strategy)
        self.step = WindowStep(
            self.train_model, self.loss_fn, self.scaler, self.precision, self.env, self.forward_chunks
        )

    def evaluate(self) -> dict[str, float]:
        with phase("evaluation"):
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        start, cpu_start = time.perf_counter(), time.process_time()
        # memory freed but kept by the allocator goes back before and after: the evaluation's peak is then what it
        # holds on top of the live set, and training goes on without its leftovers (docs/beir.md#memory)
        release_freed_memory()
        scorer = self.train_model if self.plan.strategy == "dp" else self.model  # DP: score on every GPU
        pairs, batch = self.data.dev_pairs, self.cfg.data.eval_batch_size
        data = self.cfg.data  # weights > 0: the model's scores mixed with the teacher's / first stage's, own as model_*
        metrics = ev.evaluate(
            scorer,
            self.encoder,
            pairs,
            batch,
            self.device,
            self.env,
            self.step.autocast,
            data.teacher_weight,
            data.first_stage_weight,
            "dev evaluation" if self.cfg.trainer.progress_bar else None,
        )
        release_freed_memory()
        self.eval_time_s += time.perf_counter() - start
        self.eval_cpu_s += time.process_time() - cpu_start
        if self.bar is not None:  # nor for the train bar's rate and time left (io.progress)
            self.bar.unpause()
        return metrics

    # ----------------------------------------------------------------------------------------------- train
    def fit(self) -> dict:
        cfg, env = self.cfg, self.env
        self.baseline = one_device_baseline(self)  # first: it puts back all the state it touches
        progress = self._restore() if self.resume_from else Progress()
        if progress.step >= self.data.total_steps and self._finished_before():
            # a finished run continued with nothing left to train: its metrics.json and model/ stay as they are
            return {"steps": progress.step, NOTHING_LEFT: progress.step}
        # (a run resumed at its last step whose metrics.json was never written trains nothing: it saves the model
        # and runs the final evaluation that did not finish)
        self.checkpoints = CheckpointSchedule(cfg.trainer.checkpoint_every, progress.step, self.data.total_steps)
        self.first_step = progress.step
        if progress.step == 0 and cfg.trainer.evaluate:
            progress.summary.update(ev.reference_metrics(self.data.dev_pairs) if env.is_main else {})
            if cfg.trainer.eval_before_training:
                initial = self._eval_and_log(0, progress.best)
                progress.summary.update({f"initial_{k}": v for k, v in initial.items()}, **initial)
                progress.evaluated_at = 0
        timer = self.timer = StepTimer(progress.step, self.data.total_steps, *self._training_clock())
        self.since_checkpoint = (progress.step, self._training_clock()[0])
        self.logged = []
        shown = env.is_main and cfg.trainer.progress_bar  # a bar on a terminal, else log lines (io.progress)
        self.bar = progress_meter(
            desc="train",
            unit="step",
            total=self.data.total_steps,
            initial=progress.step,
            shown=shown,
            rows_every=cfg.trainer.log_every,  # its step rows say the time left (_log_train_row): no line there
            dynamic_ncols=True,
        )
        self.train_model.train()
        train_start, off_clock_before = time.perf_counter(), self.eval_time_s + self.checkpoint_time_s
        accum = cfg.trainer.grad_accum_steps
        while progress.step < self.data.total_steps and not self.stopped:
            self.data.schedule.seek(progress.epoch, progress.batch)
            self.data.train_set.set_epoch(progress.epoch)
            batches = iter(self.data.loader)
            num_batches = self.data.schedule.num_batches(progress.epoch)
            for first in range(progress.batch, num_batches, accum):
                micro_steps = min(accum, num_batches - first)
                self._train_window(batches, first, micro_steps, progress.step + 1)
                progress.step += 1
                done = first + micro_steps
                position = (progress.epoch, done) if done < num_batches else (progress.epoch + 1, 0)
                stop = self._after_step(progress, position)
                # the step's end stamp, after its stop-request collective; evaluations are not training time
                timer.stamp(progress.step, *self._training_clock())
                if stop:  # preemption: checkpointed, the requeued job resumes
                    self.bar.close()
                    return {**progress.summary, "steps": progress.step, "preempted_at_step": progress.step}
                if progress.step >= self.data.total_steps or self.stopped:
                    break
            progress.epoch, progress.batch = progress.epoch + 1, 0
            if progress.evaluated_at != progress.step and not self.stopped and progress.step < self.data.total_steps:
                self._evaluate_into(progress)
        self._read_steps()  # before the clock stops: the device may still be running queued steps
        timer.stamp(progress.step, *self._training_clock())  # the last step's end, device drained
        self.bar.close()
        train_time = time.perf_counter() - train_start - (self.eval_time_s + self.checkpoint_time_s - off_clock_before)
        if progress.evaluated_at != progress.step and not self.stopped:  # the final evaluation is still to come
            if cfg.trainer.evaluate:
                self._save_trained(progress)
            self._evaluate_into(progress)
        model_is_best = self._best_at_end(progress)
        progress.summary.update(best_figures(progress.best, self.best_metric, dict(progress.summary), model_is_best))
        return self._finish(progress, timer, train_time)

    def _finished_before(self) -> bool:
        """Collective: whether this run had finished before (its metrics.json, as rank 0 sees it)."""
        finished = self.env.is_main and (self.output_dir / "metrics.json").is_file()
        return bool(self.env.gather_objects(finished)[0])

    def _training_clock(self) -> tuple[float, float]:
        """Wall and CPU time now, less what dev evaluations and checkpoint writes took: the clocks the step timer
        reads."""
        wall = time.perf_counter() - self.eval_time_s - self.checkpoint_time_s
        return wall, time.process_time() - self.eval_cpu_s - self.checkpoint_cpu_s

    def _train_window(self, batches, first: int, micro_steps: int, step: int) -> None:
        """One optimizer step: forward and backward over the accumulation window, then the update. Its figures
        stay on the device (self.pending) until _read_steps: no host sync here."""
        start = time.perf_counter()
        # the loss is a mean over every query of the global step, so accumulation and sharding give the
        # gradient of one big batch
        divisor = self.data.schedule.loss_divisor(first, micro_steps)
        stats, wait, busy = self.step.accumulate(batches, micro_steps, divisor)
        grad_norm = optimizer_step(self.model, self.optimizer, self.scheduler, self.scaler, self.cfg.optimizer)
        if self.hooks.after_step:
            self.hooks.after_step(step, self.model)
        seconds = time.perf_counter() - start
        self.pending.add(step, stats, grad_norm, seconds, wait, busy)

    def _read_steps(self) -> None:
        """Reads the unread steps' figures from the device (raises TrainingDiverged on a non-finite loss)."""
        for step, figures in self.pending.read(self.lr):
            self.timer.count(step, figures.wait, figures.busy, figures.queries, figures.tokens, figures.padded)
            self.logged.append(figures)
            self.bar.set_postfix(loss=f"{figures.loss:.4f}", samples_s=f"{figures.queries / figures.seconds:.1f}")

    def _after_step(self, progress: Progress, position: tuple[int, int]) -> bool:
        """Logging, evaluation and checkpoints due after this step; True when a stop request ended the run.
        Step figures are read before any of them, so that no diverged state is evaluated or saved."""
        cfg, step = self.cfg, progress.step
        self.bar.update(1)
        log_due = step % cfg.trainer.log_every == 0 or step == self.data.total_steps
        # the last step's evaluation comes after the model is saved (fit)
        eval_due = cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < self.data.total_steps
        checkpoint_due = self.checkpoints.due(step)
        if log_due or eval_due or checkpoint_due:
            self._read_steps()
        if log_due:
            self._log_train_row(progress)
        if eval_due:
            self._evaluate_into(progress, position)
        if checkpoint_due and self.checkpointed_at != step:  # else the new best's checkpoint is this one
            self._checkpoint(progress, position)
        if self.hooks.stop_requested():
            self._read_steps()
            if self.checkpointed_at != step:
                self._checkpoint(progress, position)
            return True
        return False

    def _log_train_row(self, progress: Progress) -> None:
        summary, logged = progress.summary, self.logged
        figures = logged[-1]  # the logged step's own values; the loss is the mean since the last row
        summary["train_loss"] = sum(f.loss for f in logged) / len(logged)
        if self.cfg.loss.distill_weight > 0:
            summary["train_distill_loss"] = sum(f.distill_loss for f in logged) / len(logged)
        lr = self.scheduler.get_last_lr()[0]
        gpu = gpu_memory(self.device) if self.env.is_main else {}
        at = {"step": progress.step, "total_steps": self.data.total_steps, "epoch": progress.epoch}
        at["eta"] = row_eta(self.bar)  # off a terminal the row says the time left, and counts as a progress line
        log_train_step(self.logger, self.env.is_main, **at, loss=summary["train_loss"], lr=lr, figures=figures, gpu=gpu)
        logged.clear()

    def _evaluate_into(self, progress: Progress, position: tuple[int, int] | None = None) -> None:
        """An evaluation during training. With load_best_model_at_end a new best is checkpointed, unless the run
        ends here with its weights in memory. `position`: where the run continues from (default: progress's)."""
        progress.summary.update(self._eval_and_log(progress.step, progress.best))
        progress.evaluated_at = progress.step
        new_best = progress.best.step == progress.step and self.cfg.trainer.load_best_model_at_end
        if new_best and not self.stopped and progress.step < self.data.total_steps:
            self._checkpoint(progress, position or (progress.epoch, progress.batch))

    def _finish(self, progress: Progress, timer: StepTimer, train_time: float) -> dict:
        """The run's metrics: its summary, setup facts, throughput over all ranks, times and speedup."""
        env, summary = self.env, progress.summary
        self._read_steps()
        throughput = summarize(env.gather_objects(timer.rank_record(self.device, self.model, self.optimizer)))
        # kernels (and cuDNN's attention plans) are chosen per input shape: fewer shapes, fewer plans
        summary["distinct_shapes"] = len(set().union(*env.gather_objects(self.step.shapes)))
        summary.update(rank_figures(env.gather_objects(PEAKS.snapshot())))  # tracking.phases: each phase's peak RSS
        summary.update(self.facts, **throughput, steps=progress.step, epochs=progress.epoch, stopped_early=self.stopped)
        summary["steps_this_run"] = progress.step - self.first_step  # 0: resumed at its last step, evaluated only
        if self.stop_reason:
            summary["stop_reason"] = self.stop_reason
        summary.update(train_time_s=train_time, eval_time_s=self.eval_time_s, checkpoint_time_s=self.checkpoint_time_s)
        summary.update(run_speedup(self, summary["train_samples_per_s"], summary.get("train_cpu_share"), self.baseline))
        if env.is_main:
            log_hints(summary, self.cfg.data.num_workers)
        peak = max(summary["peak_memory_mb_per_rank"])
        self.logger.log_summary({**summary, **handed_down(), "peak_memory_mb": peak})
        return summary

    def _eval_and_log(self, step: int, best: Best) -> dict[str, float]:
        """Evaluates, logs, counts the evaluation into `best` (train.best: not step 0's) and decides whether the
        run stops here: the evaluation callbacks (a sweep's pruner) and early stopping vote on the main rank,
        which hands the decision and the best so far to every rank, so that all stop at the same step."""
        if not self.cfg.trainer.evaluate:
            return {}
        metrics = self.evaluate()
        log_eval(self.logger, self.env.is_main, metrics, step)
        trainer, decision = self.cfg.trainer, None
        if self.env.is_main:
            if step > 0 and metrics:  # step 0 is the untrained reference; an evaluation without figures ranks nothing
                observe(best, step, metrics, self.best_metric, trainer.early_stopping_threshold)
            votes = [callback(step, metrics) for callback in self.eval_callbacks]  # all run: the pruner reports
            spent = patience_spent(best, trainer.early_stopping_patience)
            reason = "pruned" if any(votes) else "early_stopping" if spent else None
            decision = (reason if step < self.data.total_steps else None, best)  # the last step is never cut short
        self.stop_reason, shared = self.env.gather_objects(decision)[0]
        vars(best).update(vars(shared))
        self.stopped = self.stop_reason is not None
        if self.stopped and self.env.is_main:
            self._log_stop(step, best)
        return metrics

    def _log_stop(self, step: int, best: Best) -> None:
        if self.stop_reason == "pruned":
            log.info("stopping after the evaluation at step %d (an evaluation callback asked to)", step)
            return
        log.info(
            "early stopping after the evaluation at step %d: %d evaluation(s) without a gain in %s above %g over "
            "the best, %.4f at step %d",
            step,
            best.stale,
            self.best_metric,
            self.cfg.trainer.early_stopping_threshold,
            named_figure(best.metrics, self.best_metric),
            best.step,
        )

    def _best_at_end(self, progress: Progress) -> bool:
        """Collective. With load_best_model_at_end: the best evaluation's weights back into the model from its
        checkpoint; whether the model holds them now. Without: a line when the best was not the last."""
        best, step, name = progress.best, progress.step, self.best_metric
        if best.step < 0:
            return False
        said = f"the best evaluation was step {best.step} ({name} {named_figure(best.metrics, name):.4f}), the last "
        said += f"step {step} ({named_figure(progress.summary, name):.4f})"
        if not self.cfg.trainer.load_best_model_at_end:
            if self.env.is_main and best.step != step:
                log.info("%s; model/ holds the last (trainer.load_best_model_at_end=true keeps the best)", said)
            return False
        path = None if best.step == step else load_step_weights(self.output_dir, best.step, self._training_state())
        if path is not None:  # model/ holds the last step's weights: save() writes the best's
            self.model_saved_at = None
        if self.env.is_main:
            if best.step == step:
                log.info("%s: model/ holds it", said)
            elif path is None:
                log.warning(
                    "%s; its checkpoint %s is missing: model/ holds the last",
                    said,
                    step_dir(self.output_dir, best.step),
                )
            else:
                log.info("%s; model/ holds the best, restored from %s", said, path)
        return best.step == step or path is not None

    # ------------------------------------------------------------------------------------------ checkpoint
    def _checkpoint(self, progress: Progress, position: tuple[int, int]) -> None:
        """Collective; `position`: the epoch and batch the run continues from. With checkpoint_every=auto the main
        rank, which writes, sets every rank's next checkpoint from this one's write time and the mean step time
        since the last one (train.checkpoint_schedule)."""
        at = dataclasses.replace(progress, epoch=position[0], batch=position[1])
        protect = progress.best.step if self.cfg.trainer.load_best_model_at_end else -1  # its weights come back
        (since_step, since_clock), start = self.since_checkpoint, self._training_clock()[0]
        keep = self.cfg.trainer.keep_checkpoints
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        path = save_training_state(self.output_dir, self._training_state(), at, keep, protect)
        write_s = time.perf_counter() - wall_start
        self.checkpoint_time_s += write_s
        self.checkpoint_cpu_s += time.process_time() - cpu_start
        step_s = (start - since_clock) / (progress.step - since_step) if progress.step > since_step else 0.0
        interval = measured_interval(write_s, step_s) if self.checkpoints.auto else None
        if interval is not None:
            interval = self.env.gather_objects(interval)[0]
            self.checkpoints.written(progress.step, interval)
        if path is not None:
            then = f"; auto: the next in {counted(interval, 'step')}" if interval else ""
            log.info("checkpoint: %s (written in %.2f s, steps %.2f s%s)", path, write_s, step_s, then)
        self.checkpointed_at = progress.step
        self.since_checkpoint = (progress.step, self._training_clock()[0])

    def _restore(self) -> Progress:
        progress = restore_training_state(self.resume_from, self._training_state())
        self.logger.truncate(progress.step)
        return progress

    def _training_state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, self.scheduler, self.scaler, self.env)

    # ----------------------------------------------------------------------------------------- save, cleanup
    def save(self, metrics: dict, evaluated: bool = True) -> None:  # every rank: under fsdp they gather the weights
        """model/ with the run's metrics on its card. Where this process saved the same weights already (before
        the final evaluation), only the card is rewritten. evaluated=False: before the final evaluation."""
        if not self.cfg.trainer.save_model:
            return
        out, step = self.output_dir / "model", metrics.get("steps")
        if evaluated and self.model_saved_at is not None and self.model_saved_at == step:
            rewrite_model_card(out, self.cfg, self.env, metrics)
            return
        parts = (self.model_cfg, self.encoder, self.tokenizer, self.cfg, self.env, metrics)
        save_model(self.model, out, *parts, evaluated=evaluated)
        self.model_saved_at = step

    def _save_trained(self, progress: Progress) -> None:
        """Collective, as training ends and before the final evaluation: the last step's checkpoint (written by
        _after_step: a run killed in the evaluation resumes to just it) and model/, complete and loadable, its card
        naming the run's setup and steps but no dev figures (they come with save() after the evaluation)."""
        if self.env.is_main:
            log.info("training done at step %d: saving the model before the final evaluation", progress.step)
        self.save({**self.facts, "steps": progress.step, "epochs": progress.epoch}, evaluated=False)

    def cleanup(self) -> None:
        self.logger.finish()


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
        with phase("load"):
            trainer.setup()
        with phase("training"):
            metrics = trainer.fit()
        if "preempted_at_step" not in metrics and NOTHING_LEFT not in metrics:
            trainer.save(metrics)
    finally:
        trainer.cleanup()
    return metrics


@dataclasses.dataclass
class TrainData:
    train_set: TrainGroups
    dev_pairs: DevPairs
    sampler: object  # a data sampler: set_epoch / the resumable start
    loader: DataLoader
    schedule: object  # data.loader.FixedBatches or the token budget's sampler: batches per epoch, seek
    steps_per_epoch: int  # of the first epoch (a token budget's epochs can differ)
    total_steps: int


def build_train_data(cfg: RunConfig, env: DistEnv, plan: DevicePlan, inputs: RunInputs) -> TrainData:
    data, trainer = cfg.data, cfg.trainer
    instruction = data.instruction or cfg.model.prompt.default_instruction
    train_set = TrainGroups(inputs.train_queries, data.train_group_size, instruction, cfg.seed, data.random_negatives)
    dev_pairs = inputs.dev_pairs(instruction, cfg.seed)  # built once per process
    # DataParallel splits one process's batch over its GPUs, so that process loads all of their batches.
    loader_batch = data.batch_size * (plan.num_devices if plan.strategy == "dp" else 1)
    window = loader_batch * env.world_size * trainer.grad_accum_steps
    # data.pretokenize: the train prompts' token ids are read once per process, off the step
    encoder = pretokenized(inputs.encoder, train_set, inputs.token_ids) if data.pretokenize else inputs.encoder
    sampler, loader, schedule = train_loader(
        train_set,
        encoder,
        data,
        loader_batch,
        window,
        world_size=env.world_size,
        rank=env.rank,
        seed=cfg.seed,
        device=env.device,
        accum=trainer.grad_accum_steps,
    )
    steps_per_epoch = math.ceil(schedule.num_batches(0) / trainer.grad_accum_steps)
    total_steps = trainer.max_steps
    if trainer.max_steps <= 0:  # a token budget's epochs can differ in length (resampled negatives)
        epochs = range(trainer.max_epochs)
        total_steps = sum(math.ceil(schedule.num_batches(e) / trainer.grad_accum_steps) for e in epochs)
    return TrainData(train_set, dev_pairs, sampler, loader, schedule, steps_per_epoch, total_steps)
