"""Prompt presets encode as their upstream does: with a tokenizer that carries each preset's special tokens, the
field-by-field encoding equals tokenizing the fully rendered prompt, the chat-template rendering equals the
hand-written one, and the score is read at the prompt's last token (yes - no, or the raw yes logit)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_QWEN2, compose_config
from tokenizers import AddedToken, Tokenizer, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from lychee_exp.config.schema import to_run_config
from lychee_exp.data.prompt import PromptEncoder, render
from lychee_exp.errors import UserError
from lychee_exp.model.reranker import Reranker, answer_token_ids

# ChatML, as Qwen2.5 and Qwen3 ship it (system turn, user turn, generation prompt), without the tool branches
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EXAMPLES = [
    (
        "Given a web search query, retrieve relevant passages that answer the query",
        "what is the capital of China?",
        "The capital of China is Beijing.",
    ),
    ("Find the function", "Return the number of bytes in a file.", "Open the file and count: size in bytes."),
]


def preset(name, *overrides):
    return to_run_config(compose_config([f"model={name}", "model.path=/unused", *overrides], "/tmp/unused")).model


@pytest.fixture(scope="module")
def qwen_tok():
    """The tiny Qwen2 tokenizer plus Qwen3's think tokens (added, not special) and a ChatML chat template."""
    tok = AutoTokenizer.from_pretrained(str(TINY_QWEN2))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def gemma_tok():
    """A Gemma-like tokenizer: adds <bos> in front of every text, single-token 'Yes'/'No'."""
    raw = Tokenizer.from_file(str(TINY_QWEN2 / "tokenizer.json"))
    raw.add_special_tokens([AddedToken("<bos>", special=True)])
    raw.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in ("Yes", "No")])
    bos = raw.token_to_id("<bos>")
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<bos>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side="left",
    )


CASES = [
    ("qwen3_reranker", "qwen_tok", []),
    ("qwen3_reranker", "qwen_tok", ["model.prompt.chat_template=true"]),
    ("lychee_rerank", "qwen_tok", []),
    ("lychee_rerank", "qwen_tok", ["model.prompt.chat_template=true"]),
    ("bge_reranker_gemma", "gemma_tok", []),
]


@pytest.mark.parametrize(("name", "tok_fixture", "overrides"), CASES, ids=lambda v: str(v))
def test_field_by_field_equals_tokenizing_the_rendered_prompt(name, tok_fixture, overrides, request):
    tok = request.getfixturevalue(tok_fixture)
    cfg = preset(name, *overrides)
    encoder = PromptEncoder(tok, cfg.prompt, "left")
    for instruction, query, document in EXAMPLES:
        text = render(tok, cfg.prompt, instruction, query, document)
        ids = encoder.encode(instruction, query, document)
        # the chat template writes its own specials; otherwise the tokenizer adds them (Gemma's <bos>)
        assert ids == tok(text, add_special_tokens=not cfg.prompt.chat_template)["input_ids"]
        yes_id, _ = answer_token_ids(cfg, encoder)
        assert yes_id == tok(cfg.prompt.yes_token, add_special_tokens=False)["input_ids"][0]


def test_qwen3_prompt_is_its_published_layout(qwen_tok):
    cfg = preset("qwen3_reranker")
    text = render(qwen_tok, cfg.prompt, "Find it", "my query", "my doc")
    assert text == (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
        'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
        "<|im_start|>user\n<Instruct>: Find it\n<Query>: my query\n<Document>: my doc<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert cfg.score == "yes_minus_no" and cfg.prompt.max_len >= 4096


def test_gemma_prompt_is_flagembedding_layout(gemma_tok):
    cfg = preset("bge_reranker_gemma")
    text = render(gemma_tok, cfg.prompt, cfg.prompt.default_instruction, "q", "p")
    assert text == (
        "A: q\nB: p\nGiven a query A and a passage B, determine whether the passage contains an answer "
        "to the query by providing a prediction of either 'Yes' or 'No'."
    )
    ids = PromptEncoder(gemma_tok, cfg.prompt, "left").encode(cfg.prompt.default_instruction, "q", "p")
    assert ids[0] == gemma_tok.bos_token_id and ids.count(gemma_tok.bos_token_id) == 1
    assert cfg.score == "yes_logit"


@pytest.mark.parametrize("name", ["qwen3_reranker", "lychee_rerank"])
def test_chat_template_renders_like_the_hand_written_preset(name, qwen_tok):
    hand, chat = preset(name), preset(name, "model.prompt.chat_template=true")
    for example in EXAMPLES:
        assert PromptEncoder(qwen_tok, chat.prompt, "left").encode(*example) == PromptEncoder(
            qwen_tok, hand.prompt, "left"
        ).encode(*example)


def test_chat_template_without_one_is_user_error(gemma_tok):
    with pytest.raises(UserError, match="chat_template"):
        PromptEncoder(gemma_tok, preset("qwen3_reranker", "model.prompt.chat_template=true").prompt, "left")


def _tiny_lm(vocab_size):
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # scores that differ clearly between prompts
    return model


@pytest.mark.parametrize(("name", "tok_fixture"), [("qwen3_reranker", "qwen_tok"), ("bge_reranker_gemma", "gemma_tok")])
def test_score_is_read_at_the_last_token_of_each_left_padded_prompt(name, tok_fixture, request):
    tok = request.getfixturevalue(tok_fixture)
    cfg = preset(name)
    encoder = PromptEncoder(tok, cfg.prompt, "left")
    yes_id, no_id = answer_token_ids(cfg, encoder)
    model = _tiny_lm(len(tok))
    reranker = Reranker(model, "causal_lm", yes_id, no_id, cfg.score).eval()
    docs = ["short", "a much longer document " * 8, "medium length document here"]
    batch = encoder.pad([encoder.encode("Find it", "a query", d) for d in docs])
    with torch.no_grad():
        got = reranker(batch["input_ids"], batch["attention_mask"])
        for row, doc in enumerate(docs):
            alone = tok(render(tok, cfg.prompt, "Find it", "a query", doc), return_tensors="pt")
            last = model(**alone).logits[0, -1]
            expected = last[yes_id] if cfg.score == "yes_logit" else last[yes_id] - last[no_id]
            torch.testing.assert_close(got[row], expected, atol=1e-4, rtol=1e-4)
    assert len(set(got.tolist())) == len(docs)


@pytest.mark.parametrize("name", ["qwen3_reranker", "bge_reranker_gemma"])
def test_answer_token_that_is_not_one_token_is_one_line(name, qwen_tok):
    cfg = preset(name, "model.prompt.yes_token=affirmative")
    with pytest.raises(UserError) as info:
        answer_token_ids(cfg, PromptEncoder(qwen_tok, cfg.prompt, "left"))
    assert "model.prompt.yes_token='affirmative'" in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- length budgets
def _words(n, tag):
    return " ".join(f"{tag}{i} alpha beta" for i in range(n))


def test_short_query_leaves_its_budget_to_the_document(qwen_tok):
    cfg = preset("qwen3_reranker", "model.prompt.max_len=200", "model.prompt.query_max_len=60")
    encoder = PromptEncoder(qwen_tok, cfg.prompt, "left")
    document = _words(200, "d")
    doc_tokens = qwen_tok(" " + document, add_special_tokens=False)["input_ids"]
    short_q = encoder.encode("Find it", "tiny query", document)
    long_q = encoder.encode("Find it", _words(60, "q"), document)
    assert len(short_q) == len(long_q) == 200  # both fill the total budget exactly

    def kept(ids):  # how many of the document's tokens made it into the prompt
        return max(n for n in range(len(doc_tokens)) if any(ids[i : i + n] == doc_tokens[:n] for i in range(len(ids))))

    q_short = len(qwen_tok(" tiny query", add_special_tokens=False)["input_ids"])
    assert kept(short_q) - kept(long_q) == 60 - q_short  # the document got what the short query did not use
    tail = qwen_tok("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert short_q[-len(tail) :] == tail and long_q[-len(tail) :] == tail  # the template's end is never cut


def test_instruction_and_query_caps(qwen_tok):
    cfg = preset("qwen3_reranker", "model.prompt.instruction_max_len=5", "model.prompt.query_max_len=7")
    encoder = PromptEncoder(qwen_tok, cfg.prompt, "left")
    base = len(encoder.encode("i", "q", "doc")) - 2  # " i" and " q" are one token each
    ids = encoder.encode(_words(30, "i"), _words(30, "q"), "doc")
    assert len(ids) == base + 5 + 7
    first = qwen_tok(" " + _words(30, "i"), add_special_tokens=False)["input_ids"][:5]
    assert any(ids[k : k + 5] == first for k in range(len(ids)))  # the instruction's first 5 tokens are kept


def test_max_len_shorter_than_template_is_user_error(qwen_tok):
    cfg = preset("qwen3_reranker", "model.prompt.max_len=20")
    with pytest.raises(UserError, match="model.prompt.max_len=20"):
        PromptEncoder(qwen_tok, cfg.prompt, "left")


def test_llm_presets_allow_4k_tokens():
    for name in ("qwen3_reranker", "lychee_rerank"):
        prompt = preset(name).prompt
        assert prompt.max_len >= 4096 and prompt.doc_max_len == 0, name
