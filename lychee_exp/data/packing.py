"""Packed batches (data.packing): a micro-batch's prompts laid end to end in one row instead of padded rows.

Positions restart at each prompt, attention stays within each prompt, and each prompt's score is read at its own
last token, so every logit equals the padded batch's (fp32, up to summation order). The row is padded at its end
to a multiple of `data.pack_multiple` tokens so that a run sees few distinct shapes (kernels and cuDNN plans are
reused); that pad is its own segment, whose outputs nothing reads.

Attention: the model runs under `packed_<base>` (registered below), which is the base implementation (sdpa or
eager) for ordinary padded batches (evaluation) and, for packed ones, torch's varlen (flash) attention on CUDA in
half precision, else causal sdpa on each segment in turn (eager: a block-diagonal causal mask). Which of these
ran is recorded (`attention_paths`), and on CUDA a packed run without a working varlen kernel stops at setup
(`check_packed_attention`) unless `data.packing_fallback=sdpa` asks for the per-prompt path.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

import torch

from lychee_exp.errors import UserError
from lychee_exp.model.segment_rows import segment_rows_attention, use_segment_rows

log = logging.getLogger(__name__)

PACKED_PREFIX = "packed_"
# the model kwargs that carry the segments into every attention layer (transformers' FlashAttentionKwargs names)
CU_SEQLENS, MAX_LENGTH = "cu_seq_lens_q", "max_length_q"
BOUNDS = "packed_bounds"  # the same boundaries as host ints: slicing by them reads nothing from the device
HOST_KEYS = ("max_length", "bounds")  # what pack() returns as host values, not tensors
# The attention paths a process ran, by name: varlen (torch's flash varlen kernel), sdpa_per_prompt (one causal
# sdpa call per segment), eager_block_mask (one block-diagonal mask), <base>_padded (a padded batch). Not
# recorded while torch.compile traces (compiled layers): a compiled run reports the path decided at setup.
ATTENTION_PATHS: set[str] = set()


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


def block_causal_mask(cu_seqlens: torch.Tensor, width: int, causal: bool = True) -> torch.Tensor:
    """(1, 1, width, width) boolean: token i sees token j iff both are in the same segment (and j <= i if causal)."""
    segment = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    )
    idx = torch.arange(width, device=cu_seqlens.device)
    mask = segment[:, None] == segment[None, :]
    if causal:
        mask = mask & (idx[None, :] <= idx[:, None])
    return mask[None, None]


def varlen_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


_PROBES: dict[int, tuple[bool, str]] = {}


def varlen_probe(device: torch.device) -> tuple[bool, str]:
    """(works, why): the varlen kernel run once through `_varlen` on two tiny bf16 segments with grouped heads,
    its output compared with causal sdpa per segment. Cached per device index."""
    if not varlen_available(device):
        return False, "no varlen_attn on this device (needs CUDA and torch >= 2.10)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBES:
        _PROBES[index] = _probe(torch.device("cuda", index))
    return _PROBES[index]


def _probe(device: torch.device) -> tuple[bool, str]:
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 4, 24, 64, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 2, 24, 64, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)
    try:
        out = _varlen(None, q, k, v, cu, 14, 64**-0.5)
    except Exception as err:  # noqa: BLE001 - any failure of the kernel means: not usable here
        return False, f"varlen_attn failed: {type(err).__name__}: {str(err)[:200]}"
    if out is None:
        return False, "this torch's varlen_attn cannot apply the attention scale"
    kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(q[:, :, s:e], kr[:, :, s:e], vr[:, :, s:e], is_causal=True)
            for s, e in ((0, 10), (10, 24))
        ],
        dim=2,
    ).transpose(1, 2)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    if not err < 2e-2:  # bf16 operands: ~1e-3 expected
        return False, f"varlen_attn output differs from causal sdpa per segment (relative error {err:.3g})"
    return True, f"ok (relative error {err:.1e} against sdpa)"


def packed_attention_path(device: torch.device, precision: str, base: str, dropout: float, causal=True) -> str:
    """The path packed rows take on this device and precision (what `attention` below does with them); on CPU in
    bf16, prompts of up to segment_rows.MAX_SEGMENT_TOKENS take segment_rows (recorded as they run)."""
    half = precision in ("bf16", "fp16")
    if device.type == "cuda" and causal and half and not dropout and varlen_probe(device)[0]:
        return "varlen"
    return "sdpa_per_prompt" if base == "sdpa" else "eager_block_mask"


def check_packed_attention(
    device: torch.device, precision: str, base: str, dropout: float, fallback: str, causal: bool = True
) -> str:
    """The packed path, decided at setup; on CUDA anything but varlen is a one-line error unless
    `data.packing_fallback=sdpa` (slower: one attention call per prompt per layer, or a full mask)."""
    path = packed_attention_path(device, precision, base, dropout, causal)
    if device.type == "cuda" and path != "varlen" and fallback != "sdpa":
        why = varlen_probe(device)[1] if precision in ("bf16", "fp16") else f"trainer.precision={precision}"
        if dropout:
            why = "attention dropout is on (the varlen kernel has none)"
        if not causal:
            why = "an encoder cross-encoder attends both ways, and the varlen call here is causal"
        raise UserError(
            f"data.packing=true on CUDA without the varlen kernel ({why}): set data.packing_fallback=sdpa to run "
            f"packed rows through {path} (slower), or data.packing=false"
        )
    return path


def packed_attention_path_of(cfg, device: torch.device, precision: str) -> str:
    """A run's attention path (RunConfig `cfg`): check_packed_attention's for a packed run, else padded rows
    through the model's own attention (e.g. sdpa_padded)."""
    if cfg.data.packing is not True:  # false, or auto not yet decided for a device (config.packing_rule)
        return f"{cfg.model.attn_implementation}_padded"
    model = cfg.model
    return check_packed_attention(device, precision, model.attn_implementation, model.dropout or 0.0,
                                  cfg.data.packing_fallback, model.kind == "causal_lm")  # fmt: skip


def _record(path: str) -> None:
    if not torch.compiler.is_compiling():
        ATTENTION_PATHS.add(path)


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
            _record(f"{base}_padded")
            return base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        causal = getattr(module, "is_causal", True)  # BERT-family encoders attend both ways within a prompt
        if causal and not dropout and _use_varlen(query):  # the varlen call below is causal and has no dropout
            out = _varlen(module, query, key, value, cu_seqlens, max_length, scaling)
            if out is not None:
                _record("varlen")
                return out, None
        if base == "sdpa" and use_segment_rows(query, bounds):  # CPU bf16, short prompts: one batched matmul
            _record("segment_rows")
            return segment_rows_attention(query, key, value, bounds, scaling, causal, dropout), None
        if base == "sdpa":  # attention segment by segment: no width x width mask or scores
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
            _record("sdpa_per_prompt")
            return torch.cat(parts, dim=1), None
        _record("eager_block_mask")
        # eager adds its mask to the scores
        allowed = block_causal_mask(cu_seqlens, query.shape[2], causal)
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
