"""Packed batches (data.packing): a micro-batch's prompts laid end to end in one row instead of padded rows.

Positions restart at each prompt, attention stays within each prompt, and each prompt's score is read at its own
last token, so every logit equals the padded batch's (fp32, up to summation order). The row is padded at its end
to a multiple of `data.pack_multiple` tokens so that a run sees few distinct shapes (kernels and cuDNN plans are
reused); that pad is its own segment, whose outputs nothing reads.

Attention: the model runs under `packed_<base>` (registered below), which is the base implementation (sdpa or
eager) for ordinary padded batches (evaluation) and, for packed ones, torch's varlen (flash) attention on CUDA in
half precision, else causal sdpa on each segment in turn (eager: a block-diagonal causal mask).
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

import torch

log = logging.getLogger(__name__)

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


def block_causal_mask(cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """(1, 1, width, width) boolean: token i sees token j iff j <= i in the same segment."""
    segment = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    )
    idx = torch.arange(width, device=cu_seqlens.device)
    mask = (segment[:, None] == segment[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None]


def varlen_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


def _use_varlen(query: torch.Tensor) -> bool:
    """The flash varlen kernel: CUDA, half precision (autocast included), torch >= 2.10."""
    half = query.dtype in (torch.float16, torch.bfloat16)
    return query.device.type == "cuda" and half and varlen_available(query.device)


def _varlen(module, query, key, value, cu_seqlens, max_length, scaling) -> torch.Tensor | None:
    """torch's flash varlen kernel on (1, heads, width, dim) inputs; returns (1, width, heads, dim), or None when
    this torch's kernel cannot apply the scale. Its signature changed across releases (2.10/2.11: is_causal and
    no GQA or scale; later: window_size, enable_gqa, scale), so the arguments follow what it accepts."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    # (width, heads, dim); contiguous: RoPE leaves query and key head-major, the kernel wants token-major
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    options = {}
    if "window_size" in params:
        options["window_size"] = (-1, 0)  # causal within each segment
    else:
        options["is_causal"] = True
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "scale" in params:
        options["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
        return None
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **options)
    return out[None]


def _make_packed_attention(base: str):
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cu_seqlens = kwargs.pop(CU_SEQLENS, None)
        max_length = kwargs.pop(MAX_LENGTH, None)
        bounds = kwargs.pop(BOUNDS, None)
        for extra in ("cu_seq_lens_k", "max_length_k"):
            kwargs.pop(extra, None)
        if base == "eager":  # each model's modeling file has its own, which transformers falls back to
            base_fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            base_fn = AttentionInterface._global_mapping[base]
        if cu_seqlens is None:  # an ordinary padded batch (evaluation)
            return base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if not dropout and _use_varlen(query):  # the varlen kernel has no attention dropout
            out = _varlen(module, query, key, value, cu_seqlens, max_length, scaling)
            if out is not None:
                return out, None
        if base == "sdpa":  # causal attention segment by segment: no width x width mask or scores
            parts = [
                base_fn(
                    module,
                    *(t[:, :, s:e] for t in (query, key, value)),
                    None,
                    scaling=scaling,
                    dropout=dropout,
                    **kwargs,
                )[0]
                for s, e in zip(bounds[:-1], bounds[1:])
            ]
            return torch.cat(parts, dim=1), None
        # eager adds its mask to the scores
        allowed = block_causal_mask(cu_seqlens, query.shape[2])
        mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
        return base_fn(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)

    return attention


def packed_attention(base: str) -> str:
    """Registers (once) the attention implementation `packed_<base>` and returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = PACKED_PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _make_packed_attention(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name
