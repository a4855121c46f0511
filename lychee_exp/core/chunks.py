"""Forward chunks: within a batch, pairs of similar length go through the model together (Reranker.forward),
each chunk cut to its own longest pair, so fewer padding slots are computed."""

from __future__ import annotations


def length_chunks(lengths: list[int], chunks: int) -> list[tuple[list[int], int]]:
    """A batch's rows (by their real lengths) in `chunks` groups of equal size and similar length, each with its
    width (its longest row): forwarded apart they compute sum(rows x width) slots, not rows x the batch width.
    Equal sizes keep every chunk big enough to use a GPU well."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    count = max(1, min(chunks, len(order)))
    parts = [order[k * len(order) // count : (k + 1) * len(order) // count] for k in range(count)]
    return [(rows, max(lengths[r] for r in rows)) for rows in parts if rows]


def padded_slots(chunks: list[tuple[list[int], int]]) -> int:
    return sum(len(rows) * width for rows, width in chunks)
