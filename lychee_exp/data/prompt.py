"""A reranker's prompt: (instruction, query, document) -> token ids, within a length budget that cuts fields only.

The rendered prompt is `prefix + separator + template + suffix + answer_prefix`, the template holding
{instruction}, {query} and {document}. With `chat_template: true` the tokenizer's own chat template renders
[system message, user turn = template] with the generation prompt, then `answer_prefix` (prefix, separator and
suffix are then unused). The fields are cut to their token budgets first (the end of the
prompt, where the model answers yes/no, is never cut); then the whole text is tokenized at once, exactly as the
model's own usage tokenizes its prompt (a field's last character can merge with the text that follows, e.g. ".\n"
in Qwen's tokenizer). Should that ever come out longer than the budget, the pieces tokenized one by one are used.

Budgets: the instruction and the query are cut to their caps (`instruction_max_len`, `query_max_len`); with
`max_len` (total tokens, template and special tokens included) the document gets what is left, so a short
query leaves more room for its document; `doc_max_len` (0 = no cap of its own) caps the document as well.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from lychee_exp.config.schema import PromptConfig
from lychee_exp.errors import UserError

# Fields get their budgets in this order: the document takes what the others leave.
_PRIORITY = {"instruction": 0, "query": 1, "document": 2}
_MARK = "\x00{}\x00"  # stands in for a field while a chat template renders the prompt
_FEW = 4  # texts tokenized one call each rather than as a batch (see PromptEncoder._tokenize)
# prompts per tokenizer call in encode_many: bounds one call's untruncated fields, offsets included, in memory
# (512 documents of 2,000 tokens: ~1M tokens), while calls stay few
_BATCH = 512


@dataclass(frozen=True)
class _Field:
    name: str
    leading_space: bool  # the space before a field is tokenized with it, as BPE tokenizers expect


def _field_text(field: _Field, value: str) -> str:
    """What the tokenizer reads for a field: its value, with the space before it when the template has one."""
    return (" " if field.leading_space else "") + value


def render_format(tokenizer, prompt: PromptConfig) -> str:
    """The whole prompt as one format string with {instruction}/{query}/{document} left as fields."""
    if not prompt.chat_template:
        return prompt.prefix + prompt.separator + prompt.template + prompt.suffix + prompt.answer_prefix
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "model.prompt.chat_template=true, but this tokenizer has no chat template "
            "(set the template pieces by hand: model.prompt.prefix/template/suffix)"
        )
    names = ("instruction", "query", "document")
    user = prompt.template.format(**{n: _MARK.format(n) for n in names})
    messages = ([{"role": "system", "content": prompt.system}] if prompt.system else []) + [
        {"role": "user", "content": user}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = (text + prompt.answer_prefix).replace("{", "{{").replace("}", "}}")
    for name in names:
        text = text.replace(_MARK.format(name), "{" + name + "}")
    return text


def render(tokenizer, prompt: PromptConfig, instruction: str, query: str, document: str) -> str:
    """The full prompt text of one example, untruncated (what the model reads, as one string)."""
    return render_format(tokenizer, prompt).format(instruction=instruction, query=query, document=document)


class PromptEncoder:
    def __init__(self, tokenizer, prompt: PromptConfig, padding_side: str):
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.padding_side = padding_side
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.caps = {
            "instruction": prompt.instruction_max_len,
            "query": prompt.query_max_len,
            "document": prompt.doc_max_len,
        }  # 0 = no cap of its own
        self._format = render_format(tokenizer, prompt)
        self._pieces = self._parse(self._format)
        # (index in _pieces, field), in the order the fields get their budgets
        self._fields = sorted(
            ((i, piece) for i, piece in enumerate(self._pieces) if isinstance(piece, _Field)),
            key=lambda item: _PRIORITY[item[1].name],
        )
        # A chat template writes its own special tokens (BOS included); otherwise the tokenizer's are added.
        self._special_before, self._special_after = ([], []) if prompt.chat_template else self._special_tokens()
        self.template_len = (
            len(self._special_before)
            + len(self._special_after)
            + sum(len(piece) for piece in self._pieces if not isinstance(piece, _Field))
        )
        if prompt.max_len and self.template_len >= prompt.max_len:
            raise UserError(
                f"model.prompt.max_len={prompt.max_len} leaves no room for the fields: the template "
                f"alone is {self.template_len} tokens"
            )

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _parse(self, fmt: str) -> list:
        pieces: list = []
        literal = ""
        for text, name, _, _ in string.Formatter().parse(fmt):
            literal += text
            if name is None:
                continue
            space = literal.endswith(" ")
            pieces.append(self._tokens(literal[:-1] if space else literal))
            pieces.append(_Field(name, space))
            literal = ""
        pieces.append(self._tokens(literal))
        return pieces

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """The tokens the tokenizer wraps a single text in ([CLS] ... [SEP] for BERT, <bos> for Gemma)."""
        bare = self._tokens("a")
        wrapped = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        start = next(i for i in range(len(wrapped)) if wrapped[i : i + len(bare)] == bare)
        return wrapped[:start], wrapped[start + len(bare) :]

    def encode(self, instruction: str, query: str, document: str) -> list[int]:
        return self.encode_many([(instruction, query, document)])[0]

    def encode_many(self, prompts: Sequence[tuple[str, str, str]]) -> list[list[int]]:
        """encode() of many (instruction, query, document) prompts: the tokenizer runs on batches (a fast
        tokenizer encodes a batch on all cores), each distinct field text once per batch (a query recurs with
        each of its documents)."""
        return list(self.iter_encode(prompts))

    def lengths(self, prompts: Sequence[tuple[str, str, str]]) -> list[int]:
        """Each prompt's token count (the token cache's counterpart is a look-up)."""
        return [len(ids) for ids in self.iter_encode(prompts)]

    def iter_encode(self, prompts: Sequence[tuple[str, str, str]]) -> Iterator[list[int]]:
        """encode_many's ids one prompt at a time, a batch held at once: for callers that store them compactly."""
        for start in range(0, len(prompts), _BATCH):
            yield from self._encode_batch(prompts[start : start + _BATCH])

    def _encode_batch(self, prompts: Sequence[tuple[str, str, str]]) -> list[list[int]]:
        names = ("instruction", "query", "document")
        values = [dict(zip(names, prompt, strict=True)) for prompt in prompts]
        texts = sorted({_field_text(field, v[field.name]) for _, field in self._fields for v in values} - {""})
        encoded = self._tokenize(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else {}
        by_text = dict(zip(texts, zip(encoded.get("input_ids", []), encoded.get("offset_mapping", []))))
        planned = [self._fit(v, by_text) for v in values]
        wholes = self._tokenize(
            [self._format.format(**cut) for cut, _ in planned], add_special_tokens=not self.prompt.chat_template
        )["input_ids"]
        return [whole if len(whole) <= len(by_piece) else by_piece for whole, (_, by_piece) in zip(wholes, planned)]

    def _tokenize(self, texts: list[str], **options) -> dict[str, list]:
        """The tokenizer's output for each text: a batch in one call, a few texts (one prompt's) one at a time,
        where the batch call's thread hand-off costs more than it saves."""
        if len(texts) > _FEW:
            return self.tokenizer(texts, **options)
        outputs = [self.tokenizer(text, **options) for text in texts]
        return {key: [output[key] for output in outputs] for key in outputs[0]} if outputs else {}

    def _fit(self, values: dict[str, str], by_text: dict) -> tuple[dict[str, str], list[int]]:
        """The fields cut to their budgets: (each field's text, cut where its kept tokens end; the prompt's ids
        assembled piece by piece from the fields' own tokens)."""
        left = self.prompt.max_len - self.template_len if self.prompt.max_len else None
        tokens: dict[int, list[int]] = {}
        cut = dict(values)
        for i, field in self._fields:
            text = _field_text(field, values[field.name])
            ids, offsets = by_text.get(text, ([], []))
            keep = min(len(ids), self.caps[field.name] or len(ids), len(ids) if left is None else max(left, 0))
            if left is not None:
                left -= keep
            if keep < len(ids):
                end = offsets[keep - 1][1] if keep else 0
                text_kept = text[:end][1:] if field.leading_space else text[:end]
                cut[field.name] = min(cut[field.name], text_kept, key=len)
            tokens[i] = ids[:keep]
        by_piece = list(self._special_before)
        for i, piece in enumerate(self._pieces):
            by_piece.extend(tokens[i] if isinstance(piece, _Field) else piece)
        by_piece.extend(self._special_after)
        return cut, by_piece

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
