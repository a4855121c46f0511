"""A packed row through the model (data.packing lays it out): attention within each prompt, and the scores of an
encoder cross-encoder's packed rows.

Attention: the model runs under `packed_<base>` (registered below), which is the base implementation (sdpa or eager)
for ordinary padded batches (evaluation) and, for packed ones, torch's varlen (flash) attention on CUDA in half
precision, on CPU in bf16 the segments as padded rows of one batched matmul (short prompts), else causal sdpa on each
segment in turn (eager: a block-diagonal causal mask). Which of these ran is recorded (`ATTENTION_PATHS`), and on
CUDA a packed run without a working varlen kernel stops at setup (`check_packed_attention`) unless
`data.packing_fallback=sdpa` asks for the per-prompt path.

The matmul path, why: on CPU, sdpa's flash kernel was the costliest operator of a bf16 cross-encoder step (its
backward 30% of the step's self time, forward 6%, `python -m benchmarks.step_profile trainer.precision=bf16`), and
one sdpa call per segment adds a call per prompt per layer. Gathering the segments into (heads x segments, longest,
dim) rows and running bmm + masked softmax + bmm is faster in bf16 up to 160 tokens a segment and slower beyond
(`python -m benchmarks.attention_cpu`); in fp32 it is faster only at 64 tokens and slower from 96 on, so fp32 keeps
sdpa (`use_segment_rows`). The scores' softmax runs in float32 for bf16/fp16 inputs (as sdpa's math path does), keys
past a segment's end are masked, and each output row is read back for its own tokens only, so the result equals sdpa
per segment up to rounding (tests/test_packed_encoder.py compares them in float64, forward and backward).

Encoder cross-encoders (config.auto.PACKABLE_ENCODERS): the padded batch computes every pad slot through every
linear layer; one packed row computes only real tokens. Each prompt keeps what it has in a padded row: positions
from 0, its own token types (0 up to and including its first separator, 1 after), attention within itself only
(both ways), and its score from its own first token ([CLS]) through the model's pooler, dropout and classifier, so
every logit equals the padded batch's (fp32, up to summation order; tests/test_packed_encoder.py).
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lychee_exp.data.packing import BOUNDS, CU_SEQLENS, MAX_LENGTH, PACKED_PREFIX
from lychee_exp.errors import UserError

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


log = logging.getLogger(__name__)


# The attention paths a process ran, by name: varlen (torch's flash varlen kernel), sdpa_per_prompt (one causal
# sdpa call per segment), eager_block_mask (one block-diagonal mask), <base>_padded (a padded batch). Not
# recorded while torch.compile traces (compiled layers): a compiled run reports the path decided at setup.
ATTENTION_PATHS: set[str] = set()


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


_PROBES: dict[int, tuple[bool, str]] = {}


def varlen_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


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
    if cfg.data.packing is not True:  # false, or auto not yet decided for a device (config.auto)
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


def classifier_parts(backbone: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """(encoder, pooler, dropout, classifier) of a *ForSequenceClassification model, through a peft wrapper (LoRA
    layers sit inside these modules, and modules_to_save wrap the classifier in place)."""
    model = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    encoder = model.base_model
    pooler = getattr(encoder, "pooler", None)
    if pooler is None or not hasattr(model, "classifier"):
        raise ValueError(f"{type(model).__name__} has no pooler + classifier head: its packed rows cannot be scored")
    return encoder, pooler, model.dropout, model.classifier


def packed_token_types(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, sep_id: int) -> torch.Tensor:
    """(1, width) token types of a packed row: within each segment, 0 up to and including its first separator and 1
    after it (data.pair_prompt.token_types per prompt)."""
    width = input_ids.shape[1]
    sizes = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    is_sep = (input_ids[0] == sep_id).long()
    seen = is_sep.cumsum(0) - is_sep  # separators strictly before each position, over the whole row
    at_start = torch.repeat_interleave(seen[cu_seqlens[:-1].long().clamp(max=width - 1)], sizes)
    return ((seen - at_start) > 0).long()[None].to(input_ids.dtype)


def score_packed_encoder(backbone: nn.Module, input_ids: torch.Tensor, packed: dict, sep_id: int | None):
    """One logit per packed prompt (data.packing.pack's dict, input_ids apart)."""
    encoder, pooler, dropout, classifier = classifier_parts(backbone)
    cu_seqlens = packed["cu_seqlens"]
    types = {} if sep_id is None else {"token_type_ids": packed_token_types(input_ids, cu_seqlens, sep_id)}
    hidden = encoder(
        input_ids=input_ids,
        position_ids=packed["position_ids"],
        **types,
        **{CU_SEQLENS: cu_seqlens, MAX_LENGTH: packed["max_length"], BOUNDS: packed["bounds"]},
    ).last_hidden_state
    firsts = cu_seqlens[: packed["last_index"].shape[0]].long()  # each prompt's [CLS]
    logits = classifier(dropout(pooler(hidden[0, firsts][:, None])))
    return logits[:, 0].float().clone()  # not a view: FSDP2 hooks the output for its backward
