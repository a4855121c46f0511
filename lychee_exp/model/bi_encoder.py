"""A bi-encoder as a reranker (model.kind=bi_encoder): the query and the document are encoded apart, each pooled
to one unit vector, and the relevance logit is their cosine times the similarity scale the shipped bi-encoder was
trained with (config.schema.SCALE), so an untrained student scores exactly as its bi-encoder teacher does and its
logits sit on the teacher scores' scale for distillation.

Batches stay the text pairs every encoder kind reads (`[CLS] q [SEP] d [SEP]`): the rows of
data.pair_prompt.TextsApartEncoder, each text cut to model.prompt.max_len on its own. `split_pair` cuts each row
at its first separator into the query's own encoding (`[CLS] q [SEP]`) and the document's (`[CLS] d [SEP]`),
which is what the tokenizer gives each text alone (checked once per tokenizer, `check_pair_split`). Scoring
(ir.evaluate) encodes each distinct text of the candidate pairs once (`distinct_texts`, `text_vectors`,
`pair_scores`). Saved models carry sentence-transformers' module files (Transformer, Pooling, Normalize, with
max_len as max_seq_length), so `SentenceTransformer(<run>/model)` encodes and scores as training and scoring did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from lychee_exp.config.choices import Pooling
from lychee_exp.config.schema import SCALE
from lychee_exp.data.packing import BOUNDS, CU_SEQLENS, MAX_LENGTH, pack
from lychee_exp.errors import UserError

# sentence-transformers' pooling modes, by model.pooling
_ST_POOLING = {
    Pooling.mean: "pooling_mode_mean_tokens",
    Pooling.cls: "pooling_mode_cls_token",
    Pooling.last: "pooling_mode_lasttoken",
}


def split_pair(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, sep_id: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded pair rows -> ((query ids, mask), (document ids, mask)), each right-padded to its own width:
    the query is the row up to and including its first separator, the document the row's first token followed by
    everything after that separator."""
    lengths = attention_mask.sum(1)
    sep_at = (input_ids == sep_id).int().argmax(1)
    query_width = int(sep_at.max()) + 1
    cols = torch.arange(query_width, device=input_ids.device)
    query_mask = (cols.unsqueeze(0) <= sep_at.unsqueeze(1)).to(attention_mask.dtype)
    query_ids = input_ids[:, :query_width] * query_mask
    doc_lengths = lengths - sep_at  # the first token, then the document's tokens and its closing separator
    cols = torch.arange(int(doc_lengths.max()), device=input_ids.device).unsqueeze(0)
    source = torch.where(cols == 0, torch.zeros_like(cols), sep_at.unsqueeze(1) + cols)
    source = source.clamp(max=input_ids.shape[1] - 1)
    doc_mask = (cols < doc_lengths.unsqueeze(1)).to(attention_mask.dtype)
    doc_ids = input_ids.gather(1, source) * doc_mask
    return (query_ids, query_mask), (doc_ids, doc_mask)


def row_parts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, max_tokens: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rows in the fewest parts of equal size that each hold at most max_tokens slots (rows x width), all at
    the batch's width; the whole batch when it fits (or max_tokens is None). Equal parts keep each one large: a
    small part (under ~1,000 slots here) can take another bf16 matrix kernel on CPU, with other roundings."""
    rows, width = input_ids.shape
    count = -(-rows * width // max_tokens) if max_tokens else 1
    if count <= 1:
        return [(input_ids, attention_mask)]
    size = -(-rows // count)
    return list(zip(input_ids.split(size), attention_mask.split(size)))


def check_pair_split(tokenizer) -> int:
    """The separator split_pair cuts at; one line when this tokenizer's pairs do not split into its single texts."""
    sep = tokenizer.sep_token_id
    pair = tokenizer("a query", "a document")["input_ids"]
    alone = [tokenizer(text)["input_ids"] for text in ("a query", "a document")]
    if sep is not None:
        ids = torch.tensor([pair])
        (query, _), (doc, _) = split_pair(ids, torch.ones_like(ids), sep)
        if [query[0].tolist(), doc[0].tolist()] == alone:
            return sep
    raise UserError(
        "model.kind=bi_encoder: this tokenizer's text pairs are not [CLS] query [SEP] document [SEP] "
        f"({tokenizer.convert_ids_to_tokens(pair)}), so a pair cannot be split into the two texts"
    )


def text_vectors(
    backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling, max_tokens=None
) -> torch.Tensor:
    """Unit-norm pooled encodings of right-padded single texts, one float32 row per text; `max_tokens`: forwarded
    in row_parts of at most that many token slots."""
    parts = []
    for part_ids, part_mask in row_parts(input_ids, attention_mask, max_tokens):
        hidden = backbone(input_ids=part_ids, attention_mask=part_mask).last_hidden_state
        parts.append(nn.functional.normalize(pool(hidden.float(), part_mask, pooling), dim=-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def bi_encoder_logits(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sep_id: int,
    pooling: Pooling,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """SCALE x cosine of the pooled query and document encodings, one logit per pair row (float32). `max_tokens`:
    each side's texts forwarded in row_parts, at that side's width (Reranker.forward)."""
    query, doc = (
        text_vectors(backbone, ids, mask, pooling, max_tokens)
        for ids, mask in split_pair(input_ids, attention_mask, sep_id)
    )
    return SCALE * (query * doc).sum(-1)


def distinct_texts(token_ids: Sequence[list[int]], sep_id: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Pair rows -> (each distinct text's own token ids, each row's (query, document) text index): the cut of
    split_pair, so that scoring encodes a query shared by a hundred candidates, or a document shared by queries,
    once."""
    index: dict[tuple[int, ...], int] = {}
    pairs = []
    for row in token_ids:
        sep = row.index(sep_id)
        pairs.append(
            tuple(index.setdefault(text, len(index)) for text in (tuple(row[: sep + 1]), (row[0], *row[sep + 1 :])))
        )
    return [list(text) for text in index], pairs


def pair_scores(vectors: Sequence[np.ndarray], pairs: Sequence[tuple[int, int]]) -> list[float]:
    """SCALE x cosine of each pair's unit vectors (distinct_texts' indices), in float32: bi_encoder_logits' score."""
    if not pairs:
        return []
    table = torch.from_numpy(np.stack(vectors))
    queries, docs = (torch.tensor(side) for side in zip(*pairs))
    return (SCALE * (table[queries] * table[docs]).sum(-1)).tolist()


def bi_encoder_packed_logits(
    backbone: nn.Module, input_ids: torch.Tensor, packed: dict, sep_id: int, pooling: Pooling
) -> torch.Tensor:
    """bi_encoder_logits of a packed row of pairs (data.packing.pack, input_ids apart, with the packed attention
    loaded): each pair segment is repacked as its query's and its document's own segments, so no pad slot is
    computed and each text attends only to itself; a query shared by a group's pairs is encoded once."""
    prompts = packed["last_index"].shape[0]
    bounds, row = packed["bounds"], input_ids[0].tolist()  # host values: the packed path runs on CPU
    texts: list[list[int]] = []
    query_slot: dict[tuple[int, ...], int] = {}
    pair_slots = []  # (the query's segment, the document's segment) of each pair
    for start, end in zip(bounds[:prompts], bounds[1 : prompts + 1]):
        sep = row.index(sep_id, start, end)
        query = tuple(row[start : sep + 1])
        if query not in query_slot:
            query_slot[query] = len(texts)
            texts.append(list(query))
        pair_slots.append((query_slot[query], len(texts)))
        texts.append(row[start : start + 1] + row[sep + 1 : end])
    repacked = pack(texts, pad_id=0, multiple=1)
    model = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    device = input_ids.device
    hidden = (
        model(
            input_ids=repacked["input_ids"].to(device),
            position_ids=repacked["position_ids"].to(device),
            **{
                CU_SEQLENS: repacked["cu_seqlens"].to(device),
                MAX_LENGTH: repacked["max_length"],
                BOUNDS: repacked["bounds"],
            },
        )
        .last_hidden_state[0]
        .float()
    )
    lengths = repacked["lengths"].to(device)
    if pooling == Pooling.mean:
        segment = torch.repeat_interleave(torch.arange(len(texts), device=device), lengths)
        sums = hidden.new_zeros(len(texts), hidden.shape[-1]).index_add_(0, segment, hidden)
        pooled = sums / lengths.unsqueeze(1).to(hidden.dtype)
    else:
        starts = repacked["cu_seqlens"][:-1].long().to(device)
        pooled = hidden[starts if pooling == Pooling.cls else repacked["last_index"].to(device)]
    vectors = nn.functional.normalize(pooled, dim=-1)
    queries, docs = (torch.tensor(slots, device=device) for slots in zip(*pair_slots))
    return SCALE * (vectors[queries] * vectors[docs]).sum(-1)


def freeze_pooler(backbone: nn.Module) -> None:
    """A BERT-family AutoModel's pooler feeds no pooled vector here: frozen, so that DDP expects no gradient
    for it and the saved model keeps the checkpoint's own pooler weights."""
    for name, parameter in backbone.named_parameters():
        if name.startswith("pooler.") or ".pooler." in name:
            parameter.requires_grad_(False)


def write_sentence_transformers_files(out_dir: Path, hidden_size: int, pooling: Pooling, max_len: int) -> None:
    """sentence-transformers' module files for a saved bi-encoder: Transformer (this directory), Pooling, Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len, "do_lower_case": False}))
    pooling_config = {"word_embedding_dimension": hidden_size} | {
        mode: mode == _ST_POOLING[pooling] for mode in _ST_POOLING.values()
    }
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2) + "\n")
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    # cosine x SCALE is this reranker's logit: the same order as sentence-transformers' cosine similarity
    (out_dir / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine"}) + "\n")


def pool(hidden, mask, pooling: Pooling):
    """One vector per row of token states [rows, tokens, dim], padding (mask 0) ignored on either side."""
    import torch

    if pooling == Pooling.cls:
        return hidden[:, 0]
    if pooling == Pooling.last:  # the last real token, whichever side the tokenizer pads
        last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
