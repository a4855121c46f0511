"""One rank's training DataLoader: which queries it reads each epoch (sampler), how they become a batch, and the
schedule the trainer reads from it (batches per epoch, where a resumed epoch starts, each window's loss divisor)."""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

from lychee_exp.config.schema import DataConfig
from lychee_exp.data.budget import TokenBudgetSampler
from lychee_exp.data.groups import GroupCollator, TrainGroups
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.data.sampling import ResumableSampler, train_sampler


class FixedBatches:
    """The schedule of `batch` queries per batch (TokenBudgetSampler is the token budget's)."""

    def __init__(self, sampler: ResumableSampler, batch: int):
        self.sampler, self.batch = sampler, batch

    def num_batches(self, epoch: int) -> int:
        return math.ceil(self.sampler.num_samples / self.batch)

    def seek(self, epoch: int, batch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.sampler.start = batch * self.batch

    def loss_divisor(self, first: int, micro_steps: int) -> float:
        """This rank's queries in the window (the epoch's last batch may be short): every rank holds as many,
        so DDP's average over ranks of these means is the mean over the global step."""
        return min(self.sampler.num_samples, (first + micro_steps) * self.batch) - first * self.batch

    def mean_step_queries(self) -> None:
        return None  # the configured effective batch (train.optim.effective_batch_size)


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
    accum: int = 1,
) -> tuple[ResumableSampler | TokenBudgetSampler, DataLoader, FixedBatches | TokenBudgetSampler]:
    """`loader_batch` queries per batch (DataParallel: all of the process's GPUs); `window` queries make one
    optimizer step over all ranks. One sampler for every world size: its permutation depends on (seed, epoch)
    only, and rank r takes items r, r + world, ..., so N ranks see the same global batches as one process;
    drop_last: each query at most once per epoch, and every rank has the same number of batches.
    data.max_tokens_per_batch: micro-batches of whole groups within the token budget (data.budget)."""
    width = data.max_tokens_per_batch if data.packing else None
    collate = GroupCollator(encoder, data.pack_multiple if data.packing else None, width, train_set.group_size)
    common = {"collate_fn": collate, "num_workers": data.num_workers, "pin_memory": device.type == "cuda"}
    # (workers not persistent: they must see set_epoch's resampled negatives)
    if data.max_tokens_per_batch:
        sampler = TokenBudgetSampler(train_set, encoder, data, accum, world_size, rank, seed)
        sampler.plan(0)  # a group that does not fit the budget stops the run here, before step 1
        return sampler, DataLoader(train_set, batch_sampler=sampler, **common), sampler
    sampler = train_sampler(
        train_set, encoder, data.bucket_by_length, data.bucket_pool_batches, window, world_size, rank, seed
    )
    if sampler.num_samples == 0:
        raise ValueError(f"{len(train_set)} training queries cannot be split over {world_size} ranks")
    loader = DataLoader(train_set, batch_size=loader_batch, sampler=sampler, **common)
    return sampler, loader, FixedBatches(sampler, loader_batch)
