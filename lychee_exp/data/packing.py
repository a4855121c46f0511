"""How a micro-batch's prompts are laid out for the model: padded rows in forward chunks, or one packed row.

Forward chunks (trainer.forward_chunks): within a padded batch, pairs of similar length go through the model together
(Reranker.forward), each chunk cut to its own longest pair, so fewer padding slots are computed.

Packed rows (data.packing): a micro-batch's prompts laid end to end in one row instead of padded rows. Positions
restart at each prompt, attention stays within each prompt, and each prompt's score is read at its own last token,
so every logit equals the padded batch's (fp32, up to summation order). The row is padded at its end to a multiple
of `data.pack_multiple` tokens so that a run sees few distinct shapes (kernels and cuDNN plans are reused); that pad
is its own segment, whose outputs nothing reads. The attention over a packed row, and the scoring of packed rows
through an encoder, live in model.packed; whether a run packs, in config.auto.packing_on.
"""

from __future__ import annotations

from typing import Sequence

import torch

PACKED_PREFIX = "packed_"
# the model kwargs that carry the segments into every attention layer (transformers' FlashAttentionKwargs names)
CU_SEQLENS, MAX_LENGTH = "cu_seq_lens_q", "max_length_q"
BOUNDS = "packed_bounds"  # the same boundaries as host ints: slicing by them reads nothing from the device
HOST_KEYS = ("max_length", "bounds")  # what pack() returns as host values, not tensors


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple if multiple > 1 else length


def pack(sequences: Sequence[Sequence[int]], pad_id: int, multiple: int, width: int | None = None) -> dict:
    """One row of the sequences end to end, padded to a multiple of `multiple` (or to exactly `width`: a token
    budget's row): input_ids and position_ids (1, width), cu_seqlens (segment boundaries, the pad a segment of its
    own, int32), last_index (each sequence's last token), lengths, and as host values max_length (the varlen
    kernel wants it without a device read) and bounds (cu_seqlens as a tuple)."""
    lengths = [len(seq) for seq in sequences]
    total = sum(lengths)
    if width is None:
        width = round_up(total, multiple)
    elif total > width:
        raise ValueError(f"{total} tokens do not fit a packed row of {width}")
    ids = torch.full((1, width), pad_id, dtype=torch.long)
    positions = torch.zeros((1, width), dtype=torch.long)
    bounds, start = [0], 0
    for seq in sequences:
        ids[0, start : start + len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        positions[0, start : start + len(seq)] = torch.arange(len(seq))
        start += len(seq)
        bounds.append(start)
    if width > total:  # the rounding pad: positions from 0, so it reads as one more segment
        positions[0, total:] = torch.arange(width - total)
        bounds.append(width)
    cu = torch.tensor(bounds, dtype=torch.int32)
    return {
        "input_ids": ids,
        "position_ids": positions,
        "cu_seqlens": cu,
        "last_index": cu[1 : len(sequences) + 1].long() - 1,
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "max_length": max([*lengths, width - total]),
        "bounds": tuple(bounds),
    }


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
