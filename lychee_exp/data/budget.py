"""Token-budget batches (data.max_tokens_per_batch): each micro-batch takes whole query groups (a query with its
sampled documents) until `budget` tokens per device are full, so long prompts train a few at a time and short
ones many at a time (the Lychee paper's batches by length, as one number).

Cost of a micro-batch: packed (data.packing) the sum of its prompts' tokens, every row then padded to exactly
`budget` (one shape for the whole run); padded, its rows x its longest prompt.

The epoch's plan is a function of (seed, epoch, budget) only and every rank computes it whole: the global list of
micro-batches is padded with empty ones to a multiple of the world size, and rank r takes micro-batches r,
r + world, ... So every rank runs the same number of micro-batches and optimizer steps (an empty micro-batch
forwards a dummy group with weight 0: DDP needs each rank's backward), any rank knows each step's total query
count without a collective, and one process with world x grad_accum_steps accumulation trains the same steps.
"""

from __future__ import annotations

import random

import torch

from lychee_exp.data.groups import TrainGroups
from lychee_exp.errors import UserError

KEY = "data.max_tokens_per_batch"
# groups that do not fit a micro-batch skipped before it closes: later ones may fill its gap (first fit), which a
# packed row otherwise computes as padding
LOOKAHEAD = 32


def group_sizes(groups: TrainGroups, encoder, epoch: int) -> list[tuple[int, int]]:
    """(tokens, longest prompt) of every query's group in `epoch` (its negatives are resampled each epoch)."""
    prompts = [(instr, query, doc) for instr, query, docs, _ in groups.items_of_epoch(epoch) for doc in docs]
    lengths = encoder.lengths(prompts)  # a look-up with data.pretokenize
    size = groups.group_size
    return [(sum(lengths[k : k + size]), max(lengths[k : k + size])) for k in range(0, len(lengths), size)]


def plan_epoch(
    sizes: list[tuple[int, int]], budget: int, packing: bool, group_size: int, seed: int, epoch: int, pool: int
) -> list[list[int]]:
    """The epoch's micro-batches (query indices), in order: each takes the order's next groups that fit, until
    LOOKAHEAD + 1 have not (they start the next one). `pool` > 0: length bucketing, pools of `pool`
    micro-batches' worth of queries sorted by length before they are cut (less padding), the micro-batches then
    shuffled. A group that cannot fit alone is a UserError naming the key and the budget it needs."""

    def cost(tokens: int, width: int, groups: int) -> int:
        return tokens if packing else groups * group_size * width

    worst = max(range(len(sizes)), key=lambda i: cost(*sizes[i], 1))
    need = cost(*sizes[worst], 1)
    if need > budget:
        how = "tokens" if packing else f"token slots ({group_size} rows x {sizes[worst][1]})"
        raise UserError(
            f"{KEY}={budget} cannot hold one query group: query {worst}'s group needs {need} {how}; "
            f"set {KEY} >= {need}, or lower model.prompt.max_len or data.train_group_size"
        )
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)  # the permutation the fixed-size sampler starts from
    order = torch.randperm(len(sizes), generator=generator).tolist()
    if pool:
        mean = sum(cost(*s, 1) for s in sizes) / len(sizes)
        span = max(1, round(pool * budget / mean))
        order = [i for k in range(0, len(order), span) for i in sorted(order[k : k + span], key=sizes.__getitem__)]
    batches: list[list[int]] = []
    waiting = list(reversed(order))  # the order's next group last
    while waiting:
        current, tokens, width, misses, k = [], 0, 0, 0, len(waiting) - 1
        while k >= 0 and misses <= LOOKAHEAD:
            t, w = sizes[waiting[k]]
            if cost(tokens + t, max(width, w), len(current) + 1) <= budget:
                current.append(waiting[k])
                tokens, width, waiting[k] = tokens + t, max(width, w), -1
            else:
                misses += 1
            k -= 1
        kept = [i for i in waiting[k + 1 :] if i >= 0]  # only the scanned tail changed
        del waiting[k + 1 :]
        waiting.extend(kept)
        batches.append(current)
    if pool:
        random.Random(f"{seed}:{epoch}:budget").shuffle(batches)
    return batches


class TokenBudgetSampler:
    """A DataLoader batch_sampler: this rank's micro-batches of the epoch (query indices; [] = an empty one),
    and the schedule the trainer reads (batches per epoch, each window's loss divisor, the mean step size)."""

    def __init__(self, groups: TrainGroups, encoder, data, accum: int, world_size: int, rank: int, seed: int):
        self.groups, self.encoder, self.budget, self.packing = groups, encoder, data.max_tokens_per_batch, data.packing
        self.pool = data.bucket_pool_batches if data.bucket_by_length else 0
        self.accum, self.world_size, self.rank, self.seed = accum, world_size, rank, seed
        self.epoch, self.start = 0, 0
        self._plans: dict[int, list[list[int]]] = {}

    def plan(self, epoch: int) -> list[list[int]]:
        """All ranks' micro-batches, padded with [] to a multiple of the world size."""
        if epoch not in self._plans:
            sizes = group_sizes(self.groups, self.encoder, epoch)
            batches = plan_epoch(sizes, self.budget, self.packing, self.groups.group_size, self.seed, epoch, self.pool)
            batches += [[] for _ in range(-len(batches) % self.world_size)]
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}  # the epochs still read
            self._plans[epoch] = batches
        return self._plans[epoch]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def seek(self, epoch: int, batch: int) -> None:
        self.epoch, self.start = epoch, batch

    def num_batches(self, epoch: int) -> int:
        return len(self.plan(epoch)) // self.world_size

    def window_queries(self, first: int, micro_steps: int) -> int:
        """Queries of every rank in the window of this rank's batches first..first + micro_steps - 1."""
        world = self.world_size
        return sum(len(b) for b in self.plan(self.epoch)[first * world : (first + micro_steps) * world])

    def loss_divisor(self, first: int, micro_steps: int) -> float:
        """What each rank divides its summed loss by: DDP averages gradients over ranks, so global queries /
        world gives the mean over every query of the global step, whatever each rank holds."""
        return self.window_queries(first, micro_steps) / self.world_size

    def mean_step_queries(self) -> float:
        """Mean queries per optimizer step in the first epoch's plan (the LR scaling rule's effective batch)."""
        batches = self.num_batches(0)
        steps = -(-batches // self.accum)
        return sum(len(b) for b in self.plan(0)) / steps

    def __iter__(self):
        return iter(self.plan(self.epoch)[self.rank :: self.world_size][self.start :])

    def __len__(self) -> int:
        return self.num_batches(self.epoch) - self.start


def first_epoch_sizes(cfg, inputs) -> tuple[list[tuple[int, int]], TrainGroups]:
    """group_sizes of the first epoch from a run's config and inputs (train.inputs.RunInputs); the token ids it
    reads stay in inputs.token_ids for the ranks that train in this process."""
    from lychee_exp.data.token_cache import pretokenized  # token_cache builds on data

    data = cfg.data
    instruction = data.instruction or cfg.model.prompt.default_instruction
    groups = TrainGroups(inputs.train_queries, data.train_group_size, instruction, cfg.seed, data.random_negatives)
    encoder = pretokenized(inputs.encoder, groups, inputs.token_ids) if data.pretokenize else inputs.encoder
    return group_sizes(groups, encoder, 0), groups


def check_token_budget(cfg, inputs, packing: bool) -> None:
    """Preflight (the Hydra process, before any rank starts): the first epoch's plan, so that a group that cannot
    fit data.max_tokens_per_batch is one line. A later epoch's resampled group that no longer fits stops that
    epoch's plan the same way."""
    data = cfg.data
    if data.max_tokens_per_batch:
        sizes, groups = first_epoch_sizes(cfg, inputs)
        plan_epoch(sizes, data.max_tokens_per_batch, packing, groups.group_size, cfg.seed, 0, 0)
