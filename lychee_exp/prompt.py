"""Lychee's prompt: (instruction, query, document) -> token ids, truncating the query and document only.

The prompt is `prefix + separator + template + suffix`, the template holding {instruction}, {query} and
{document}. Literal pieces are tokenized once; fields are tokenized per example and truncated to their own
budgets, so the template's end (where the model answers yes/no) is never cut off.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Sequence

import torch

from lychee_exp.config import PromptConfig
from lychee_exp.errors import UserError


@dataclass(frozen=True)
class _Field:
    name: str
    leading_space: bool  # the space before a field is tokenized with it, as BPE tokenizers expect


class PromptEncoder:
    def __init__(self, tokenizer, prompt: PromptConfig, padding_side: str):
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.padding_side = padding_side
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_len = {"query": prompt.query_max_len, "document": prompt.doc_max_len}
        self._pieces = self._parse()
        self._special_before, self._special_after = self._special_tokens()

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _parse(self) -> list:
        p = self.prompt
        pieces: list = []
        literal = p.prefix + p.separator
        for text, name, _, _ in string.Formatter().parse(p.template):
            literal += text
            if name is None:
                continue
            space = literal.endswith(" ")
            pieces.append(self._tokens(literal[:-1] if space else literal))
            pieces.append(_Field(name, space))
            literal = ""
        pieces.append(self._tokens(literal + p.suffix))
        return pieces

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """The tokens the tokenizer wraps a single text in ([CLS] ... [SEP] for BERT, nothing for Qwen)."""
        bare = self._tokens("a")
        wrapped = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        start = next(i for i in range(len(wrapped)) if wrapped[i:i + len(bare)] == bare)
        return wrapped[:start], wrapped[start + len(bare):]

    def encode(self, instruction: str, query: str, document: str) -> list[int]:
        values = {"instruction": instruction, "query": query, "document": document}
        ids = list(self._special_before)
        for piece in self._pieces:
            if isinstance(piece, _Field):
                text = (" " if piece.leading_space else "") + values[piece.name]
                tokens = self._tokens(text)
                limit = self.max_len.get(piece.name)
                ids.extend(tokens[:limit] if limit else tokens)
            else:
                ids.extend(piece)
        ids.extend(self._special_after)
        return ids

    def pad(self, sequences: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            cols = slice(width - len(seq), width) if self.padding_side == "left" else slice(0, len(seq))
            input_ids[row, cols] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, cols] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def single_token_id(self, key: str, text: str) -> int:
        ids = self._tokens(text)
        if len(ids) != 1:
            raise UserError(f"{key}={text!r} is {len(ids)} tokens for this tokenizer; it must be exactly one")
        return ids[0]
