"""Attention over a packed row's segments as padded rows of one batched matmul: the CPU bf16 path for short prompts.

Why: on CPU, sdpa's flash kernel was the costliest operator of a bf16 cross-encoder step (its backward 30% of the
step's self time, forward 6%, `python -m benchmarks.step_profile trainer.precision=bf16`), and one sdpa call
per segment adds a call per prompt per layer. Gathering the segments into (heads x segments, longest, dim) rows and
running bmm + masked softmax + bmm is faster in bf16 up to 160 tokens a segment and slower beyond
(`python -m benchmarks.attention_cpu`); in fp32 it is faster only at 64 tokens and slower from 96 on, so fp32
keeps sdpa (data.packing decides, `use_segment_rows`).

The scores' softmax runs in float32 for bf16/fp16 inputs (as sdpa's math path does), keys past a segment's end are
masked, and each output row is read back for its own tokens only, so the result equals sdpa per segment up to
rounding (tests/test_packed_encoder.py compares them in float64, forward and backward).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

# Longest segment the matmul path takes (bf16 on CPU): 2.24x sdpa's speed at 96 tokens, 1.73x at 160, 0.88x at 192
# (forward + backward, 32 segments, 2 threads, docs/benchmarks.md "Attention on CPU")
MAX_SEGMENT_TOKENS = 160


def use_segment_rows(query: torch.Tensor, bounds: Sequence[int]) -> bool:
    """The matmul path: CPU, bf16 operands (autocast's output included) and every segment short enough."""
    if query.device.type != "cpu" or query.dtype != torch.bfloat16:
        return False
    return max(e - s for s, e in zip(bounds[:-1], bounds[1:])) <= MAX_SEGMENT_TOKENS


def segment_rows_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: Sequence[int],
    scaling: float | None,
    causal: bool,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of a packed row (1, heads, width, dim) within each segment [bounds[i], bounds[i+1]) (the bounds
    cover the whole width); returns (1, width, heads, dim), transformers' attention output layout. Grouped-query
    keys and values are repeated to the query's heads."""
    heads, width, dim = query.shape[1], query.shape[2], query.shape[3]
    if key.shape[1] != heads:
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    device = query.device
    starts = torch.tensor(bounds[:-1], device=device)
    lengths = torch.tensor(bounds[1:], device=device) - starts
    longest = int(max(b - a for a, b in zip(bounds[:-1], bounds[1:])))
    offsets = torch.arange(longest, device=device)
    valid = offsets[None, :] < lengths[:, None]  # (segments, longest)
    index = (starts[:, None] + offsets[None, :]).clamp(max=width - 1)  # past a segment's end: masked below
    rows = len(lengths)
    # heads-major (heads * segments, longest, dim): the gather's own layout, so no transpose is copied
    q, k, v = (t[0][:, index].reshape(heads * rows, longest, dim) for t in (query, key, value))
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)  # in place: bmm's backward does not read its output
    blocked = ~valid[:, None, :]  # keys past each segment's end, broadcast over heads and queries
    if causal:
        blocked = blocked | torch.ones(longest, longest, dtype=torch.bool, device=device).triu(1)
    scores.view(heads, rows, longest, longest).masked_fill_(blocked, float("-inf"))
    half = scores.dtype in (torch.bfloat16, torch.float16)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if half else None).to(v.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    out = torch.bmm(probs, v).view(heads, rows, longest, dim).permute(1, 2, 0, 3)  # (segments, longest, heads, dim)
    return out[valid][None]  # the segments' own tokens, in row order: (1, width, heads, dim)
