"""The dense first stage: the blocked top-k equals a stable sort of the whole score matrix (ties included), the
retrieved run is the full matrix's top-k when the corpus spans many blocks, each pooling is what it says on a
hand computation, and prompts change the embeddings and every cache key they decide; BM25 stems by default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from beir_helpers import fruit_dataset, write_beir

from lychee_exp.config.schema import DenseConfig
from lychee_exp.io.user_files import resolve_path
from lychee_exp.ir import dense as dense_module
from lychee_exp.ir.dense import corpus_embeddings, embed, top_k_by_blocks
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.pipeline import open_split
from lychee_exp.model.bi_encoder import pool


def _full_top_k(queries, docs, k):
    scores = queries @ docs.T
    rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, rows, axis=1), rows


@pytest.mark.parametrize(("k", "block_rows", "query_rows"), [(9, 4, 3), (9, 7, 100), (60, 4, 2), (1, 50, 1)])
def test_the_blocked_top_k_equals_a_stable_sort_of_the_whole_matrix(k, block_rows, query_rows):
    """Small integers: every product is exact, so ties are real and many (and duplicate rows tie everywhere)."""
    rng = np.random.default_rng(0)
    docs = rng.integers(-2, 3, size=(50, 6)).astype(np.float32)
    docs[[7, 31, 44]] = docs[3]  # duplicates across blocks
    queries = rng.integers(-2, 3, size=(7, 6)).astype(np.float32)
    scores, rows = top_k_by_blocks(queries, docs, k, block_rows, query_rows)
    want_scores, want_rows = _full_top_k(queries, docs, min(k, len(docs)))
    assert rows.shape == want_rows.shape == (7, min(k, 50))
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(scores, want_scores)


def test_a_dense_run_over_many_blocks_is_the_full_matrix_top_k(tmp_path, ir_cache, monkeypatch):
    corpus, split = open_split(str(fruit_dataset(tmp_path / "fruit")), "test")
    monkeypatch.setattr(dense_module, "BLOCK_ROWS", 5)  # 48 documents: 10 blocks
    run = retrieve("dense", corpus, split, 7)
    dense = DenseConfig()
    docs = corpus_embeddings(corpus, dense)
    queries = embed([split.queries[q] for q in split.query_ids], dense)
    scores = queries @ docs.T
    for i, qid in enumerate(split.query_ids):
        best = np.argsort(-scores[i], kind="stable")[:7]
        assert list(run[qid]) == [corpus.ids[r] for r in best]
        assert list(run[qid].values()) == pytest.approx([float(scores[i, r]) for r in best], abs=1e-5)


def test_pool_picks_the_first_the_last_real_token_or_the_mean_whichever_side_pads():
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)  # row 0: 0..3, row 1: 4..7
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert pool(hidden, right, "last").flatten().tolist() == [1.0, 7.0]
    assert pool(hidden, left, "last").flatten().tolist() == [3.0, 7.0]
    assert pool(hidden, right, "cls").flatten().tolist() == [0.0, 4.0]
    assert pool(hidden, right, "mean").flatten().tolist() == [0.5, 5.5]
    assert pool(hidden, left, "mean").flatten().tolist() == [2.5, 5.5]


def test_each_pooling_equals_a_hand_computation_on_unpadded_texts():
    """MiniLM on one text at a time (no padding): the first, last and mean token states, unit norm; the batched
    embed, whose shorter text is padded, must give the same."""
    from transformers import AutoModel, AutoTokenizer

    texts = ["a short query", "a much longer passage about how apples grow in the valley every spring"]
    path = str(resolve_path(DenseConfig().model, "dense.model"))
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    expected = {"cls": [], "last": [], "mean": []}
    with torch.inference_mode():
        for text in texts:
            states = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            for name, vector in (("cls", states[0]), ("last", states[-1]), ("mean", states.mean(0))):
                expected[name].append(torch.nn.functional.normalize(vector, dim=-1).numpy())
    got = {name: embed(texts, DenseConfig(pooling=name)) for name in expected}
    for name in expected:
        np.testing.assert_allclose(got[name], np.stack(expected[name]), atol=1e-5)
    assert np.abs(got["cls"] - got["mean"]).max() > 0.1 and np.abs(got["last"] - got["mean"]).max() > 0.1


def test_prompts_change_the_embeddings_and_the_cache_keys(tmp_path, ir_cache):
    plain = DenseConfig()
    prompted = DenseConfig(query_prompt="query: ", passage_prompt="passage: ")
    np.testing.assert_allclose(embed(["apple"], plain, "query: "), embed(["query: apple"], plain), atol=1e-6)
    assert np.abs(embed(["apple"], plain, "query: ") - embed(["apple"], plain)).max() > 0.01
    corpus, split = open_split(str(fruit_dataset(tmp_path / "fruit")), "test")
    a, b = corpus_embeddings(corpus, plain), corpus_embeddings(corpus, prompted)
    np.testing.assert_allclose(b, embed(["passage: " + t for t in corpus.texts], plain), atol=1e-5)
    assert np.abs(a - b).max() > 0.01 and len(list((ir_cache / "dense").glob("*.npy"))) == 2
    runs = [retrieve("dense", corpus, split, 5, d) for d in (plain, prompted, DenseConfig(query_prompt="query: "))]
    assert runs[0] != runs[1] != runs[2] and len(list((ir_cache / "runs").glob("*.json"))) == 3
    for changed in (DenseConfig(pooling="cls"), DenseConfig(max_len=8)):  # each its own embeddings and run
        retrieve("dense", corpus, split, 5, changed)
    assert len(list((ir_cache / "dense").glob("*.npy"))) == 4 and len(list((ir_cache / "runs").glob("*.json"))) == 5


def test_bm25_stems_as_lucene_by_default_and_each_stemmer_has_its_own_index_and_run(tmp_path, ir_cache):
    docs = {"d1": "the runner runs every day", "d2": "cooking pasta at home", "d3": "a quiet afternoon"}
    root = write_beir(tmp_path / "ds", docs, {"q1": "running"}, {"test": {"q1": {"d1": 1}}})
    corpus, split = open_split(str(root), "test")
    stemmed = retrieve("bm25", corpus, split, 3)
    unstemmed = retrieve("bm25", corpus, split, 3, stemmer="none")
    assert stemmed["q1"]["d1"] > 0  # running -> run <- runs (Porter)
    assert all(score == 0 for score in unstemmed["q1"].values())
    assert len(list((ir_cache / "bm25").iterdir())) == 2 and len(list((ir_cache / "runs").glob("*.json"))) == 2
    assert retrieve("bm25", corpus, split, 3) == stemmed  # read back from its own cache
