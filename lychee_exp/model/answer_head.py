"""The yes/no answer head: a causal LM reranker's relevance logit from its LM head's yes and no rows only.

The score reads two logits at one position per prompt, yet the causal LM's own forward projects that position onto
the whole vocabulary (151,936 rows at Qwen2.5-1.5B), forward and backward, to keep two of them. Here the decoder
runs without its head and the scored positions' hidden states meet one row: w_yes - w_no for `yes_minus_no`
(h·w_yes - h·w_no = h·(w_yes - w_no)), w_yes for `yes_logit`, plus the bias's same entries if the head has one. The
logit is the full path's, without the (rows, vocab) logits or their gradient (benchmarks.yes_no_head times
both). It is computed in fp32 whatever the model's dtype: a difference of two large logits, each rounded to bf16
on the full path, loses its low bits, and one row costs nothing.

Where the two-row path could differ from the model's own forward, `split_backbone` gives None and the caller takes
the full path: architectures whose forward does more than lm_head(decoder(...)) (logit scaling, soft-capping), a
head that is not a plain nn.Linear (LoRA on lm_head, a quantised layer: its own forward is the truth), and a head
whose weight is still a sharded DTensor (FSDP2 gathers the root's parameters, the head's included, before
Reranker.forward runs: a DTensor there means a layout this path was not written for). It lives apart from
model/reranker.py, which keeps the Reranker's batching; this module only knows how one logit is read.
"""

from __future__ import annotations

import torch
from torch import nn

from lychee_exp.model.precision import full_precision

# model_type -> its causal LM's forward is exactly lm_head(model(...)[positions]) (transformers 5); others (Gemma2's
# soft-capping, Cohere's logit_scale, Granite's logits_scaling, ...) keep the full path.
PLAIN_HEADS = frozenset({"qwen2", "qwen3", "llama", "mistral", "gemma"})


def split_backbone(backbone: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, LM head) of a transformers causal LM, under peft its base model's (the LoRA layers are injected
    in place, so the decoder runs them); None where the full forward must be used (see the module docstring)."""
    model = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    if getattr(model.config, "model_type", None) not in PLAIN_HEADS:
        return None
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is None or decoder is model or type(head) is not nn.Linear or _is_dtensor(head.weight):
        return None
    return decoder, head


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def answer_row_logit(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, yes_id: int, no_id: int | None
) -> torch.Tensor:
    """(rows, hidden) -> (rows,): h·(w_yes - w_no) + (b_yes - b_no), or with no_id None the yes logit alone;
    in fp32. A gradient reaches the hidden states and, where they train, the two rows of weight and bias."""
    row = weight[yes_id].float() if no_id is None else _difference(weight, yes_id, no_id)
    with full_precision(hidden.device.type):  # fp32 even under bf16 autocast (module docstring)
        logit = (hidden.float() @ row.unsqueeze(1)).squeeze(1)  # a matmul, as FLOP counters count the head
    if bias is None:
        return logit.clone()  # not a view: FSDP2 hooks the output for its backward
    return logit + (bias[yes_id].float() if no_id is None else _difference(bias, yes_id, no_id))


def _difference(tensor: torch.Tensor, yes_id: int, no_id: int) -> torch.Tensor:
    """tensor[yes_id] - tensor[no_id] in fp32, read through one strided view of the two rows: where the head
    trains, its backward writes both rows into one vocabulary-sized gradient (two row reads would build one each
    and their sum; a gather, an index tensor and a scatter); no index tensor crosses to the device."""
    low, high = sorted((yes_id, no_id))
    pair = tensor[low : high + 1 : high - low].float()  # rows low and high (yes_id != no_id: one-token answers)
    return pair[0] - pair[1] if yes_id == low else pair[1] - pair[0]


def full_answer(logits: torch.Tensor, yes_id: int, no_id: int | None) -> torch.Tensor:
    """The same logit read from full-vocabulary logits (rows, vocab): the fallback path, and the reference."""
    if no_id is None:
        return logits[:, yes_id].float().clone()  # not a view (as above)
    return logits[:, yes_id].float() - logits[:, no_id].float()


def answer_logits(
    backbone: nn.Module, keep: int | torch.Tensor, yes_id: int, no_id: int | None, **inputs
) -> torch.Tensor:
    """One relevance logit per kept position of a causal LM's forward on `inputs`: `keep` as transformers'
    logits_to_keep (1: each row's last position; a 1-D index: those positions of the one packed row)."""
    parts = split_backbone(backbone)
    if parts is None:
        logits = backbone(**inputs, logits_to_keep=keep).logits
        return full_answer(logits.flatten(0, 1), yes_id, no_id)
    decoder, head = parts
    hidden = decoder(**inputs).last_hidden_state
    hidden = hidden[:, -keep:] if isinstance(keep, int) else hidden[:, keep]
    return answer_row_logit(hidden.flatten(0, 1), head.weight, head.bias, yes_id, no_id)
