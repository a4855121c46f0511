"""Tokenize once per run: every (instruction, query, document) prompt of the train set encoded before training,
so that drawing a batch only looks token ids up (the step no longer runs the tokenizer).

The ids live with the process's RunInputs (core/inputs.py), so a process that runs several jobs on the same inputs
(a sweep worker, a warm rank) tokenizes once; they are keyed by the prompt's texts, so another instruction or a
prompt never seen before (an easy negative borrowed from another query) is encoded on first use and kept.
Stored as int32 arrays (a Python list of ids costs ~9x the memory); `encode` returns a list, as PromptEncoder's.
"""

from __future__ import annotations

import numpy as np

from lychee_exp.core.data.groups import TrainGroups
from lychee_exp.core.prompt import PromptEncoder


class CachedEncoder:
    """A PromptEncoder whose `encode` reads a per-process cache; every other attribute is the encoder's."""

    def __init__(self, encoder: PromptEncoder, cache: dict):
        self.encoder, self.cache = encoder, cache

    def encode(self, instruction: str, query: str, document: str) -> list[int]:
        key = (instruction, query, document)
        ids = self.cache.get(key)
        if ids is None:
            ids = self.cache[key] = np.asarray(self.encoder.encode(instruction, query, document), dtype=np.int32)
        return ids.tolist()

    def __getattr__(self, name: str):
        if name in ("encoder", "cache"):  # not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.encoder, name)


def pretokenized(encoder: PromptEncoder, groups: TrainGroups, cache: dict) -> CachedEncoder:
    """An encoder over `cache`, filled with every pair a training group can draw from its own query's documents."""
    cached = CachedEncoder(encoder, cache)
    for q in groups.queries:
        instruction = q.instruction or groups.instruction
        for doc in (*q.pos, *q.neg):
            if (instruction, q.query, doc) not in cache:
                cached.encode(instruction, q.query, doc)
    return cached
