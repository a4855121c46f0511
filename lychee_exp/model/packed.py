"""A packed row through the model (data.packing lays it out): attention within each prompt, and the scores of an
encoder cross-encoder's packed rows.

Attention: the model runs under `packed_<base>` (registered below), which is the base implementation (sdpa or eager)
for ordinary padded batches (evaluation) and, for packed ones, torch's varlen (flash) attention on CUDA in half
precision, else sdpa on each prompt in turn (`per_prompt_attention`; eager: a block-diagonal mask). Which of these
ran is recorded (`ATTENTION_PATHS`), and on CUDA a packed run without a working varlen kernel stops at setup
(`check_packed_attention`) unless `data.packing_fallback=sdpa` asks for the per-prompt path.

On CPU, why per prompt and why float32 in training: the bf16 bare loop (padded rows) spent half of its step in
sdpa's flash backward (154-175 of 320-338 ms self CPU per 1000 tokens on a 2-core Intel Xeon with AMX, where bf16
matmuls are fast and attention is not), which float32 attention does in 0.35-0.8x the time (`float32_for_backward`,
`python -m benchmarks.attention_cpu`); an earlier path here (bf16 bmm + softmax over padded segment rows) lost to
it at every prompt length measured.

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
from torch import nn

from lychee_exp.data.packing import BOUNDS, CU_SEQLENS, MAX_LENGTH, PACKED_PREFIX
from lychee_exp.errors import UserError
from lychee_exp.model.precision import full_precision


def float32_for_backward(query: torch.Tensor) -> bool:
    """Attention that gradients flow through, on CPU in bf16/fp16 (autocast's output included), computes in
    float32: torch's CPU bf16 attention forward + backward took 1.3-2.8x its float32 time on a packed row's
    prompts (by length), while its forward alone (scoring) is faster in bf16 and stays there
    (`python -m benchmarks.attention_cpu`)."""
    half = query.dtype in (torch.bfloat16, torch.float16)
    return half and query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad


def per_prompt_attention(base_fn, module, query, key, value, bounds: Sequence[int], scaling, dropout, **kwargs):
    """The base implementation (sdpa) on each segment [bounds[i], bounds[i+1]) of a packed row (1, heads, width,
    dim); returns (1, width, heads, dim). The segments are split views: their backward is one concatenation, where
    slicing each segment out would fill a zero gradient of the whole row per segment (quadratic in the prompts)."""
    dtype = query.dtype
    if float32_for_backward(query):
        query, key, value = query.float(), key.float(), value.float()
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    # autocast off: its CPU policy would cast the float32 operands back down
    with full_precision(query.device.type):
        parts = [
            base_fn(module, q, k, v, None, scaling=scaling, dropout=dropout, **kwargs)[0]
            for q, k, v in zip(*(t.split(sizes, dim=2) for t in (query, key, value)))
        ]
    return torch.cat(parts, dim=1).to(dtype)


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
        if base == "sdpa":  # attention segment by segment: no width x width mask or scores
            _record("sdpa_per_prompt")
            return per_prompt_attention(base_fn, module, query, key, value, bounds, scaling, dropout, **kwargs), None
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
