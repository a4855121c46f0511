"""Ranking data in FlagEmbedding's JSONL format, training groups, and the batches the model reads.

One query per line: {"query": str, "pos": [str, ...], "neg": [str, ...], "instruction": str (optional)};
other keys are ignored. A training example is a group: 1 positive + (train_group_size - 1) sampled negatives.
Dev files use the same format; each query's pos + neg are the candidates to rerank.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from itertools import islice

import torch
from torch.utils.data import Dataset, DistributedSampler

from lychee_exp.errors import UserError
from lychee_exp.prompt import PromptEncoder
from lychee_exp.resources import resolve_path


@dataclass
class RankingQuery:
    query: str
    pos: list[str]
    neg: list[str] = field(default_factory=list)
    instruction: str | None = None
    qid: str = ""


def load_queries(spec: str, key: str, limit: int = 0) -> list[RankingQuery]:
    """Reads and checks a JSONL file; any problem is one UserError naming file:line."""
    path = resolve_path(spec, key)
    if path.is_dir():
        raise UserError(f"{key}={spec}: {path} is a directory, not a JSONL file")
    queries: list[RankingQuery] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            queries.append(_parse_line(line, f"{path}:{number}", len(queries)))
            if limit and len(queries) >= limit:
                break
    if not queries:
        raise UserError(f"{key}={spec}: {path} holds no queries")
    return queries


def _parse_line(line: str, where: str, index: int) -> RankingQuery:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with query/pos/neg, got {type(record).__name__}")
    query = record.get("query")
    if not isinstance(query, str) or not query.strip():
        raise UserError(f"{where}: 'query' must be a non-empty string")
    pos, neg = record.get("pos"), record.get("neg", [])
    for name, value in (("pos", pos), ("neg", neg)):
        if not isinstance(value, list) or not all(isinstance(doc, str) for doc in value):
            raise UserError(f"{where}: '{name}' must be a list of strings")
    if not pos:
        raise UserError(f"{where}: query has no positive ('pos' is empty or missing)")
    instruction = record.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise UserError(f"{where}: 'instruction' must be a string")
    return RankingQuery(query, pos, neg, instruction, str(record.get("qid", index)))


def check_negatives(queries: list[RankingQuery], group_size: int, random_negatives: int = 0) -> None:
    if group_size - 1 > random_negatives:  # some negatives must come from the file
        for q in queries:
            if not q.neg:
                raise UserError(f"data.train_file: query {q.qid!r} has no negatives, but "
                                f"data.train_group_size={group_size} needs {group_size - 1}")


class TrainGroups(Dataset):
    """Item i = (instruction, query, [positive, negative, ...]) with negatives resampled each epoch.

    Sampling depends only on (seed, epoch, i), so any split of the items across ranks, and a resumed run,
    sees exactly the groups a single process would.
    """

    def __init__(self, queries: list[RankingQuery], group_size: int, instruction: str, seed: int,
                 random_negatives: int = 0):
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

    def __getitem__(self, index: int) -> tuple[str, str, list[str]]:
        q = self.queries[index]
        rng = random.Random(f"{self.seed}:{self.epoch}:{index}")
        need = self.group_size - 1 - self.random_negatives
        # Too few negatives: sample with replacement, as FlagEmbedding does.
        negatives = rng.sample(q.neg, need) if len(q.neg) >= need else rng.choices(q.neg, k=need)
        others = [i for i in rng.sample(range(len(self.queries)), min(len(self.queries), self.random_negatives + 1))
                  if i != index][:self.random_negatives]
        negatives += [rng.choice(self.queries[i].pos) for i in others]
        return q.instruction or self.instruction, q.query, [rng.choice(q.pos), *negatives]


class GroupCollator:
    """Tokenizes a list of groups into one padded batch of len(groups) * group_size prompts."""

    def __init__(self, encoder: PromptEncoder):
        self.encoder = encoder

    def __call__(self, groups: list[tuple[str, str, list[str]]]) -> dict[str, torch.Tensor]:
        ids = [self.encoder.encode(instr, query, doc) for instr, query, docs in groups for doc in docs]
        return self.encoder.pad(ids)


@dataclass
class DevPairs:
    """Every (query, candidate) pair of the dev set, tokenized once; candidates in a seeded shuffled order so
    that ties cannot favour the positive."""

    query_index: list[int]
    labels: list[int]
    token_ids: list[list[int]]
    texts: list[tuple[str, str]]  # (query, document), for lexical baselines


def build_dev_pairs(queries: list[RankingQuery], encoder: PromptEncoder, instruction: str, seed: int) -> DevPairs:
    pairs = DevPairs([], [], [], [])
    for qi, q in enumerate(queries):
        candidates = [(doc, 1) for doc in q.pos] + [(doc, 0) for doc in q.neg]
        random.Random(f"{seed}:dev:{qi}").shuffle(candidates)
        for doc, label in candidates:
            pairs.query_index.append(qi)
            pairs.labels.append(label)
            pairs.token_ids.append(encoder.encode(q.instruction or instruction, q.query, doc))
            pairs.texts.append((q.query, doc))
    return pairs


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch (resume) without touching the batches it skips."""

    start = 0  # items of this rank's shard to skip in the current epoch

    def __iter__(self):
        return islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start
