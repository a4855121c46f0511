"""Length-bucketed batches: queries whose prompts have similar lengths train together, so batches pad less;
and the DistributedSampler that can resume mid-epoch.

The order of an epoch is a function of (seed, epoch) and the step window (queries per optimizer step across all
devices) only: shuffle every query, sort pools of `bucket_pool_batches` windows by prompt length, cut them into
windows, shuffle the full windows (a short last one stays last, where drop_last trims it). Rank r then takes
positions r, r + world, ... as DistributedSampler does, so every window holds the same queries on any number of
ranks (DDP == one process), every rank has the same number of batches, and a resumed run skips into the same order.
"""

from __future__ import annotations

import random
from itertools import islice

import torch
from torch.utils.data import DistributedSampler

from lychee_exp.data.groups import TrainGroups
from lychee_exp.data.prompt import PromptEncoder


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch (resume) without touching the batches it skips."""

    start = 0  # items of this rank's shard to skip in the current epoch

    def __iter__(self):
        return islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


class PromptLengths:
    """Token length of each training group's longest prompt in an epoch, up to a constant (only the order
    matters): the query's prompt without its document plus the longest sampled document, both truncated."""

    def __init__(self, groups: TrainGroups, encoder: PromptEncoder):
        self.groups, self.encoder = groups, encoder
        self._docs: dict[str, int] = {}
        prompts = [(q.instruction or groups.instruction, q.query, "") for q in groups.queries]
        self._query = [len(ids) for ids in encoder.encode_many(prompts)]
        # what a document may take: its own cap, and what the total budget (model.prompt.max_len) leaves
        cap, total = encoder.caps["document"] or float("inf"), encoder.prompt.max_len
        self._doc_limit = [min(cap, total - base if total else cap) for base in self._query]

    def _doc_lengths(self, docs: list[str]) -> list[int]:
        new = sorted({d for d in docs if d not in self._docs})
        if new:
            ids = self.encoder.tokenizer([" " + d for d in new], add_special_tokens=False)["input_ids"]
            self._docs.update({d: len(t) for d, t in zip(new, ids)})
        return [self._docs[d] for d in docs]

    def __call__(self, epoch: int) -> list[int]:
        docs = [docs for _, _, docs, _ in self.groups.items_of_epoch(epoch)]
        return [
            base + min(limit, max(self._doc_lengths(group)))
            for base, limit, group in zip(self._query, self._doc_limit, docs)
        ]


def bucketed_order(lengths: list[int], window: int, pool_windows: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)  # the same permutation DistributedSampler would start from
    order = torch.randperm(len(lengths), generator=generator).tolist()
    pool = window * pool_windows
    windows: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lengths.__getitem__)  # stable: ties keep shuffled order
        windows += [chunk[i : i + window] for i in range(0, len(chunk), window)]
    tail = [windows.pop()] if windows and len(windows[-1]) < window else []
    random.Random(f"{seed}:{epoch}:buckets").shuffle(windows)
    return [index for w in windows + tail for index in w]


class LengthBucketSampler(ResumableSampler):
    def __init__(
        self,
        groups: TrainGroups,
        lengths: PromptLengths,
        window: int,
        pool_windows: int,
        num_replicas: int,
        rank: int,
        seed: int,
    ):
        super().__init__(groups, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.lengths, self.window, self.pool_windows = lengths, window, pool_windows

    def __iter__(self):
        order = bucketed_order(self.lengths(self.epoch), self.window, self.pool_windows, self.seed, self.epoch)
        return islice(iter(order[self.rank : self.total_size : self.num_replicas]), self.start, None)


def train_sampler(
    groups: TrainGroups,
    encoder: PromptEncoder,
    bucket: bool,
    pool_windows: int,
    window: int,
    world_size: int,
    rank: int,
    seed: int,
) -> ResumableSampler:
    """`window`: queries per optimizer step over all devices (per-device batch x devices x accumulation)."""
    if not bucket:
        return ResumableSampler(groups, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return LengthBucketSampler(groups, PromptLengths(groups, encoder), window, pool_windows, world_size, rank, seed)
