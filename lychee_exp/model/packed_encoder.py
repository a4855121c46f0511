"""Packed rows through a BERT-family cross-encoder (data.packing; config.packing_rule.PACKABLE_ENCODERS).

The padded batch computes every pad slot through every linear layer; one packed row computes only real tokens.
Each prompt keeps what it has in a padded row: positions from 0, its own token types (0 up to and including its
first separator, 1 after), attention within itself only (data.packing's `packed_<base>` attention, both ways), and
its score from its own first token ([CLS]) through the model's pooler, dropout and classifier, so every logit
equals the padded batch's (fp32, up to summation order; tests/test_packed_encoder.py).
"""

from __future__ import annotations

import torch
from torch import nn

from lychee_exp.data.packing import BOUNDS, CU_SEQLENS, MAX_LENGTH


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
