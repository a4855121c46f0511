"""A cross-encoder's input: (query side, document) as the tokenizer's own text pair, the way sentence-transformers'
CrossEncoder and FlagEmbedding's FlagReranker feed it (`tokenizer(queries, documents, truncation=True,
max_length=...)`: `[CLS] q [SEP] d [SEP]` with token_type_ids for BERT-family models, `<s> q </s></s> d </s>` for
XLM-R). A model trained here therefore scores the same in those libraries, and one trained there scores here as
its authors score it.

The query side is `model.prompt.query_template` ({instruction} and {query}; default the query alone). The budget is
`model.prompt.max_len` tokens in all, cut longest-first as those libraries cut (0: the tokenizer's own maximum);
the per-field caps of the causal-LM prompt (query_max_len, doc_max_len) do not apply. save_reranker writes the
budget as the tokenizer's model_max_length, which is where sentence-transformers reads it. A bi-encoder's rows
(TextsApartEncoder) cut each text to `model.prompt.max_len` on its own instead.

token_type_ids are not carried through batching: the reranker derives them from the first separator of each row
(`token_types`), which gives exactly the tokenizer's (checked once per tokenizer here).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from lychee_exp.config.schema import PromptConfig
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.errors import UserError

# what a tokenizer without a real maximum (model_max_length ~1e30) is cut to
FALLBACK_MAX_LEN = 512
_BATCH = 512  # pairs per tokenizer call


def pair_max_len(tokenizer, prompt: PromptConfig) -> int:
    own = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else FALLBACK_MAX_LEN
    return prompt.max_len or own


def token_types(input_ids: torch.Tensor, attention_mask: torch.Tensor, sep_id: int) -> torch.Tensor:
    """Segment ids of right-padded pair rows: 0 up to and including the first separator, 1 after it (padding 0),
    as a BERT tokenizer writes them."""
    is_sep = (input_ids == sep_id).long()
    before = is_sep.cumsum(-1) - is_sep  # separators strictly before each position
    return ((before > 0).long() * attention_mask).to(input_ids.dtype)


class PairEncoder(PromptEncoder):
    """PromptEncoder's interface (encode_many, iter_encode, lengths, pad) over tokenizer pairs."""

    def __init__(self, tokenizer, prompt: PromptConfig, padding_side: str = "right"):
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.padding_side = padding_side
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_len = pair_max_len(tokenizer, prompt)
        self.template_len = tokenizer.num_special_tokens_to_add(pair=True)
        if self.template_len >= self.max_len:
            raise UserError(f"model.prompt.max_len={self.max_len} leaves no room for the query and the document")
        if "{document}" in prompt.query_template:
            raise UserError(
                f"model.prompt.query_template={prompt.query_template!r}: the document is the pair's "
                "second text and cannot be in the query side"
            )
        self.sep_id = self._check_token_types()

    def _check_token_types(self) -> int | None:
        """The separator that token_types() splits rows at, or None when the model reads no token types."""
        if "token_type_ids" not in self.tokenizer.model_input_names:
            return None
        probe = self.tokenizer("a query", "a document", return_token_type_ids=True)
        ids = torch.tensor([probe["input_ids"]])
        sep = self.tokenizer.sep_token_id
        derived = token_types(ids, torch.ones_like(ids), sep)[0].tolist() if sep is not None else None
        if derived != probe["token_type_ids"]:
            raise UserError(
                f"model.path: this tokenizer's pairs do not split at its separator ({self.tokenizer.sep_token!r}); "
                "set model.prompt.text_pair=false to feed it one templated string"
            )
        return sep

    def query_side(self, instruction: str, query: str) -> str:
        return self.prompt.query_template.format(instruction=instruction, query=query)

    def iter_encode(self, prompts: Sequence[tuple[str, str, str]]) -> Iterator[list[int]]:
        for start in range(0, len(prompts), _BATCH):
            batch = prompts[start : start + _BATCH]
            encoded = self.tokenizer(
                [self.query_side(instruction, query) for instruction, query, _ in batch],
                [document for _, _, document in batch],
                truncation=True,
                max_length=self.max_len,
            )
            yield from encoded["input_ids"]


class TextsApartEncoder(PairEncoder):
    """A bi-encoder's rows (model.kind=bi_encoder): the query side and the document each tokenized alone and cut to
    `max_len` on its own, as sentence-transformers encodes each text (its max_seq_length), then joined as the
    tokenizer's pair row (`[CLS] q [SEP] d [SEP]`), which model.bi_encoder.split_pair cuts back into the two.
    A long document is therefore read the same whatever the query's length, in training and in scoring."""

    def iter_encode(self, prompts: Sequence[tuple[str, str, str]]) -> Iterator[list[int]]:
        for start in range(0, len(prompts), _BATCH):
            batch = prompts[start : start + _BATCH]
            sides = [self.query_side(instruction, query) for instruction, query, _ in batch]
            queries, docs = (
                self.tokenizer(texts, truncation=True, max_length=self.max_len)["input_ids"]
                for texts in (sides, [document for _, _, document in batch])
            )
            yield from (query + doc[1:] for query, doc in zip(queries, docs))  # the document's own [CLS] dropped
