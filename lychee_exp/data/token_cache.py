"""Tokenize once per run: every (instruction, query, document) prompt of the train set encoded before training,
so that drawing a batch only looks token ids up (the step no longer runs the tokenizer).

The ids live with the process's RunInputs (train/inputs.py), so a process that runs several jobs on the same inputs
(a sweep worker, a warm rank) tokenizes once; they are keyed by the prompt's texts, so another instruction or a
prompt never seen before (an easy negative borrowed from another query) is encoded on first use and kept.
Stored as int32 arrays (a Python list of ids costs ~9x the memory); `encode` returns a list, as PromptEncoder's.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from lychee_exp.data.groups import TrainGroups
from lychee_exp.data.prompt import PromptEncoder


class CachedEncoder:
    """A PromptEncoder whose `encode`/`encode_many` read a per-process cache; every other attribute is the
    encoder's."""

    def __init__(self, encoder: PromptEncoder, cache: dict):
        self.encoder, self.cache = encoder, cache

    def encode(self, instruction: str, query: str, document: str) -> list[int]:
        return self.encode_many([(instruction, query, document)])[0]

    def encode_many(self, prompts: Sequence[tuple[str, str, str]]) -> list[list[int]]:
        self.fill(prompts)
        return [self.cache[prompt].tolist() for prompt in prompts]

    def lengths(self, prompts: Sequence[tuple[str, str, str]]) -> list[int]:
        """Each prompt's token count, without copying its ids."""
        self.fill(prompts)
        return [len(self.cache[prompt]) for prompt in prompts]

    def fill(self, prompts: Iterable[tuple[str, str, str]]) -> None:
        """Encodes the prompts not in the cache yet (in batches: PromptEncoder.encode_many) and keeps them."""
        missing = list(dict.fromkeys(prompt for prompt in prompts if prompt not in self.cache))
        for prompt, ids in zip(missing, self.encoder.iter_encode(missing), strict=True):  # a batch at a time
            self.cache[prompt] = np.asarray(ids, dtype=np.int32)

    def __getattr__(self, name: str):
        if name in ("encoder", "cache"):  # not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.encoder, name)


def pretokenized(encoder: PromptEncoder, groups: TrainGroups, cache: dict) -> CachedEncoder:
    """An encoder over `cache`, filled with every pair a training group can draw from its own query's documents."""
    cached = CachedEncoder(encoder, cache)
    cached.fill((q.instruction or groups.instruction, q.query, doc) for q in groups.queries for doc in (*q.pos, *q.neg))
    return cached
