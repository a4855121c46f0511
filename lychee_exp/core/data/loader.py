"""One rank's training DataLoader: which queries it reads each epoch (sampler) and how they become a batch."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from lychee_exp.core.config import DataConfig
from lychee_exp.core.data.groups import GroupCollator, TrainGroups
from lychee_exp.core.data.sampling import ResumableSampler, train_sampler
from lychee_exp.core.prompt import PromptEncoder


def train_loader(
    train_set: TrainGroups,
    encoder: PromptEncoder,
    data: DataConfig,
    loader_batch: int,
    window: int,
    world_size: int,
    rank: int,
    seed: int,
    device: torch.device,
) -> tuple[ResumableSampler, DataLoader]:
    """`loader_batch` queries per batch (DataParallel: all of the process's GPUs); `window` queries make one
    optimizer step over all ranks. One sampler for every world size: its permutation depends on (seed, epoch)
    only, and rank r takes items r, r + world, ..., so N ranks see the same global batches as one process;
    drop_last: each query at most once per epoch, and every rank has the same number of batches."""
    sampler = train_sampler(
        train_set, encoder, data.bucket_by_length, data.bucket_pool_batches, window, world_size, rank, seed
    )
    if sampler.num_samples == 0:
        raise ValueError(f"{len(train_set)} training queries cannot be split over {world_size} ranks")
    loader = DataLoader(
        train_set,
        batch_size=loader_batch,
        sampler=sampler,
        collate_fn=GroupCollator(encoder, data.pack_multiple if data.packing else None),
        num_workers=data.num_workers,  # not persistent: workers must see set_epoch's resampled negatives
        pin_memory=device.type == "cuda",
    )
    return sampler, loader
