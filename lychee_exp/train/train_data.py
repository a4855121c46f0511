"""What one rank trains on and for how long: the training groups, the dev pairs, the DataLoader and its schedule,
and the step counts that follow from them (the Trainer's data half of setup)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.utils.data import DataLoader

from lychee_exp.config.schema import RunConfig
from lychee_exp.data.groups import DevPairs, TrainGroups
from lychee_exp.data.loader import train_loader
from lychee_exp.data.token_cache import pretokenized
from lychee_exp.parallel.devices import DevicePlan
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.train.inputs import RunInputs


@dataclass
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
