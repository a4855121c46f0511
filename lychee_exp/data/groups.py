"""Training groups (1 positive + sampled negatives per query), their collated batches, and dev pairs."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from lychee_exp.data.packing import pack
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.data.queries import RankingQuery, check_negatives

log = logging.getLogger(__name__)


class TrainGroups(Dataset):
    """Item i = (instruction, query, [positive, negative, ...], teacher scores or None), negatives resampled each
    epoch. Easy (other queries') negatives have no teacher score for this query: NaN, left out of distillation.

    Sampling depends only on (seed, epoch, i), so any split of the items across ranks, and a resumed run,
    sees exactly the groups a single process would.
    """

    def __init__(
        self, queries: list[RankingQuery], group_size: int, instruction: str, seed: int, random_negatives: int = 0
    ):
        check_negatives(queries, group_size, random_negatives)
        self.queries, self.group_size, self.instruction, self.seed = queries, group_size, instruction, seed
        # easy negatives: other queries' positives, mixed in so that a short run learns what relevance
        # looks like before it learns to separate the hard (retrieved) negatives
        self.random_negatives = min(random_negatives, group_size - 1)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.queries)

    def items_of_epoch(self, epoch: int) -> list[tuple[str, str, list[str], list[float] | None]]:
        """Every item as `epoch` samples it (its negatives decide its length), the current epoch left as it is."""
        saved = self.epoch
        self.epoch = epoch
        try:
            return [self[i] for i in range(len(self))]
        finally:
            self.epoch = saved

    def __getitem__(self, index: int) -> tuple[str, str, list[str], list[float] | None]:
        q = self.queries[index]
        rng = random.Random(f"{self.seed}:{self.epoch}:{index}")
        need = self.group_size - 1 - self.random_negatives
        # Indices, so that teacher scores follow their documents. Too few negatives: sample with replacement,
        # as FlagEmbedding does.
        picked = rng.sample(range(len(q.neg)), need) if len(q.neg) >= need else rng.choices(range(len(q.neg)), k=need)
        others = [
            i
            for i in rng.sample(range(len(self.queries)), min(len(self.queries), self.random_negatives + 1))
            if i != index
        ][: self.random_negatives]
        easy = [rng.choice(self.queries[i].pos) for i in others]
        pos = rng.choice(range(len(q.pos)))
        docs = [q.pos[pos], *(q.neg[j] for j in picked), *easy]
        scores = None
        if q.has_teacher_scores:
            scores = [q.pos_scores[pos], *(q.neg_scores[j] for j in picked), *[math.nan] * len(easy)]
        return q.instruction or self.instruction, q.query, docs, scores


class GroupCollator:
    """Tokenizes a list of groups into one padded batch of len(groups) * group_size prompts (with `pack_multiple`:
    one packed row, data.packing.pack, of exactly `width` tokens when given: a token budget's row), plus the
    groups' teacher scores (`teacher_scores`, one row per group) when every group has them.

    No groups (a token-budget rank whose share of the epoch ran out): one dummy group of one-token prompts,
    marked `dummy`, that the step forwards with weight 0, so that the rank still joins DDP's backward."""

    def __init__(
        self, encoder: PromptEncoder, pack_multiple: int | None = None, width: int | None = None, group_size=1
    ):
        self.encoder, self.pack_multiple, self.width, self.group_size = encoder, pack_multiple, width, group_size

    def __call__(self, groups: list[tuple[str, str, list[str], list[float] | None]]) -> dict[str, torch.Tensor]:
        if not groups:
            return self._dummy()
        ids = self.encoder.encode_many([(instr, query, doc) for instr, query, docs, _ in groups for doc in docs])
        batch = self._layout(ids)
        if all(scores is not None for *_, scores in groups):
            batch["teacher_scores"] = torch.tensor([scores for *_, scores in groups], dtype=torch.float32)
        return batch

    def _layout(self, ids: list[list[int]]) -> dict:
        if self.pack_multiple:
            return pack(ids, self.encoder.pad_id, self.pack_multiple, self.width)
        return self.encoder.pad(ids)

    def _dummy(self) -> dict:
        batch = self._layout([[self.encoder.pad_id]] * self.group_size)
        batch.update(teacher_scores=torch.zeros(1, self.group_size), dummy=True)
        return batch


@dataclass
class DevPairs:
    """Every (query, candidate) pair of the dev set, tokenized once; candidates in a seeded shuffled order so
    that ties cannot favour the positive."""

    query_index: list[int]
    labels: list[int]  # relevance gain: 0 for negatives, pos_labels (default 1) for positives
    token_ids: list[list[int]]
    texts: list[tuple[str, str]]  # (query, document), for lexical baselines
    teacher_scores: list[float] | None = None  # the file's pos_scores/neg_scores when every line has them
    first_stage_scores: list[float] | None = None  # a BEIR split's candidates: the first stage's own scores
    # ir.evaluate.reference_metrics, kept: a process that reuses these pairs (a warm trial) ranks them once
    references: dict[str, float] = field(default_factory=dict)


def build_dev_pairs(queries: list[RankingQuery], encoder: PromptEncoder, instruction: str, seed: int) -> DevPairs:
    pairs = DevPairs([], [], [], [])
    teacher: list[float] = []
    prompts: list[tuple[str, str, str]] = []
    scored = all(q.has_teacher_scores for q in queries)
    for qi, q in enumerate(queries):
        gains = q.pos_labels or [1] * len(q.pos)
        scores = (q.pos_scores or []) + (q.neg_scores or []) if scored else [0.0] * (len(q.pos) + len(q.neg))
        candidates = list(zip(q.pos + q.neg, gains + [0] * len(q.neg), scores))
        random.Random(f"{seed}:dev:{qi}").shuffle(candidates)
        for doc, label, score in candidates:
            pairs.query_index.append(qi)
            pairs.labels.append(label)
            prompts.append((q.instruction or instruction, q.query, doc))
            pairs.texts.append((q.query, doc))
            teacher.append(score)
    pairs.token_ids = encoder.encode_many(prompts)
    pairs.teacher_scores = teacher if scored else None
    return pairs
