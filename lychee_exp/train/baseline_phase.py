"""The first phase of a multi-device launch, inside the started ranks: when no reliable one-device figure is
cached for the run's settings, rank 0 alone times a few of the run's own training steps on its own device (the
unwrapped model: no gradient all-reduce, one device's work) while the other ranks wait, then puts back every
piece of state those steps touched (trainable weights, optimizer, schedule and grad-scaler state, RNG states), so
that the run trains exactly as without the phase; its data iterator is a fresh one. Ranks launched elsewhere
(torchrun, SLURM) run the same phase. The figure and its judgement belong to lychee_exp.tracking.speedup."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time

import torch

from lychee_exp.parallel.devices import DevicePlan
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.tracking.speedup import Baseline, cached_baseline, cpu_share, speedup_facts, store_baseline
from lychee_exp.train.checkpoint import rng_state, set_rng_state, trainable_state
from lychee_exp.train.optim import optimizer_step
from lychee_exp.train.step import WindowStep

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # allocator and kernel warm-up, not timed
TIMED_STEPS = 3


def run_devices(env: DistEnv, plan: DevicePlan) -> int:
    """Every device whose batches make one step, over all nodes (DataParallel: one process's GPUs)."""
    return plan.num_devices if plan.strategy == "dp" else env.world_size


def one_device_plan(plan: DevicePlan) -> DevicePlan:
    return dataclasses.replace(plan, strategy="single", num_devices=1)


def one_device_baseline(trainer) -> Baseline | None:
    """The run's one-device figure, the same on every rank (collective): cached, else measured by rank 0 now.
    None when the run is one device itself (its own figure, see run_speedup) or trainer.measure_speedup=false.
    DataParallel's one process feeds all its GPUs at once, and an FSDP rank computes nothing without the others'
    shards, so neither has a one-device step to time: cache only (e.g. an earlier parallel=single run's)."""
    cfg, env, plan = trainer.cfg, trainer.env, trainer.plan
    if not cfg.trainer.measure_speedup or run_devices(env, plan) == 1:
        return None
    found = cached_baseline(cfg, one_device_plan(plan)) if env.is_main else None
    if env.is_main and found is None and plan.strategy not in ("dp", "fsdp"):
        began = time.perf_counter()
        found = _time_one_device(trainer)
        share = "" if found.cpu_share is None else f" at {100 * found.cpu_share:.0f}% CPU"
        seconds = time.perf_counter() - began
        log.info(
            "speedup: one device timed in the launch's first phase: %.3g samples/s%s (%.1f s)",
            found.samples_per_s,
            share,
            seconds,
        )
        store_baseline(cfg, one_device_plan(plan), found)
    return env.gather_objects(found)[0]


def run_speedup(trainer, samples_per_s: float, run_cpu_share: float | None, baseline: Baseline | None) -> dict:
    """The run's speedup facts. A one-device run is its own baseline (1.0x by definition, whatever the load),
    cached by rank 0 for later multi-device runs when its CPU share says the machine was not shared."""
    cfg, env, plan = trainer.cfg, trainer.env, trainer.plan
    devices = run_devices(trainer.env, plan)
    if devices == 1 and cfg.trainer.measure_speedup:
        own = f"run {trainer.output_dir}"
        if env.is_main:
            store_baseline(cfg, plan, Baseline(samples_per_s, own, run_cpu_share))
        baseline = Baseline(samples_per_s, own)
    missing = "trainer.measure_speedup=false"
    if cfg.trainer.measure_speedup:  # dp and fsdp take a cached figure only (one_device_baseline)
        missing = f"parallel={plan.strategy} times no one device: run the same settings once with parallel=single"
    return speedup_facts(samples_per_s, baseline, devices, plan, missing)


def _time_one_device(trainer) -> Baseline:
    model, optimizer, scheduler, scaler = trainer.model, trainer.optimizer, trainer.scheduler, trainer.scaler
    saved = (trainable_state(model), copy.deepcopy(optimizer.state_dict()), scheduler.state_dict(), rng_state())
    scaler_state = scaler.state_dict()
    # a step of its own (not the run's): a one-process env, so no collective and no DDP gradient sync
    step = WindowStep(
        model, trainer.loss_fn, scaler, trainer.precision, DistEnv(device=trainer.device), trainer.forward_chunks
    )
    accum, device = trainer.cfg.trainer.grad_accum_steps, trainer.device
    divisor = float(trainer.cfg.data.batch_size * accum)  # the loss's scale does not change the step's time
    batches = _endless(trainer)
    queries = []
    for index in range(WARMUP_STEPS + TIMED_STEPS):
        if index == WARMUP_STEPS:
            _drain(device)
            wall, cpu = time.perf_counter(), time.process_time()
        stats, _, _ = step.accumulate(batches, accum, divisor)
        optimizer_step(model, optimizer, scheduler, scaler, trainer.cfg.optimizer)
        if index >= WARMUP_STEPS:
            queries.append(stats[2])
    _drain(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    samples_per_s = float(sum(q.item() for q in queries)) / wall
    share = cpu_share(cpu, wall, torch.get_num_threads()) if device.type == "cpu" else None
    _restore(trainer, *saved, scaler_state)
    return Baseline(samples_per_s, f"launch phase of {trainer.output_dir}", share)


def _endless(trainer):
    """Rank 0's own batches from a fresh iterator, again from the top when the epoch is short."""
    while True:
        trainer.data.schedule.seek(0, 0)
        trainer.data.train_set.set_epoch(0)
        yield from iter(trainer.data.loader)


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _restore(trainer, weights: dict, optimizer_state: dict, scheduler_state: dict, rngs: dict, scaler: dict) -> None:
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if name in weights:
                param.copy_(weights[name])
    trainer.optimizer.load_state_dict(optimizer_state)
    trainer.scheduler.load_state_dict(scheduler_state)
    if scaler:  # empty when the scaler is off (no fp16)
        trainer.scaler.load_state_dict(scaler)
    trainer.optimizer.zero_grad(set_to_none=True)
    set_rng_state(rngs)
