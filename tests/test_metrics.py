"""ranking_metrics agrees with trec_eval (pytrec_eval); the BM25 baseline ranks the lexical match first."""

from __future__ import annotations

import math
import random

import pytest
import pytrec_eval

from lychee_exp.data.groups import DevPairs
from lychee_exp.ir.evaluate import bm25_scores, ranking_metrics


def random_dev_set(seed: int, n_queries: int, signed: bool):
    """Queries with 3-40 candidates, random binary labels (>= 1 positive), distinct random scores."""
    rng = random.Random(seed)
    scores, labels, query_index = [], [], []
    used = set()
    for qi in range(n_queries):
        n = rng.randint(3, 40)
        q_labels = [int(rng.random() < rng.choice([0.05, 0.2, 0.5])) for _ in range(n)]
        if not any(q_labels):
            q_labels[rng.randrange(n)] = 1
        for label in q_labels:
            while True:
                s = rng.gauss(0.0, 3.0) if signed else rng.uniform(0.001, 10.0)
                if s not in used:
                    used.add(s)
                    break
            scores.append(s)
            labels.append(label)
            query_index.append(qi)
    return scores, labels, query_index


def pytrec_reference(scores, labels, query_index, k=10):
    qrels, run = {}, {}
    for row, (s, label, qi) in enumerate(zip(scores, labels, query_index)):
        qrels.setdefault(f"q{qi}", {})[f"d{row}"] = label
        run.setdefault(f"q{qi}", {})[f"d{row}"] = float(s)
    ndcg = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    # trec's recip_rank has no cutoff: evaluate the run truncated to each query's top k for MRR@k.
    top = {q: dict(sorted(docs.items(), key=lambda kv: -kv[1])[:k]) for q, docs in run.items()}
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top)
    queries = sorted(qrels)
    return {
        "ndcg@10": sum(ndcg[q]["ndcg_cut_10"] for q in queries) / len(queries),
        "mrr@10": sum(rr[q]["recip_rank"] for q in queries) / len(queries),
    }


def assert_matches_pytrec(scores, labels, query_index):
    ours = ranking_metrics(scores, labels, query_index)
    ref = pytrec_reference(scores, labels, query_index)
    assert ours["ndcg@10"] == pytest.approx(ref["ndcg@10"], abs=1e-6)
    assert ours["mrr@10"] == pytest.approx(ref["mrr@10"], abs=1e-6)
    return ours, ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_pytrec_eval_positive_scores(seed):
    scores, labels, query_index = random_dev_set(seed, n_queries=200, signed=False)
    ours, ref = assert_matches_pytrec(scores, labels, query_index)
    assert 0.05 < ref["mrr@10"] < 0.95  # a mix of hits and misses, so the comparison means something


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_pytrec_eval_signed_scores(seed):
    scores, labels, query_index = random_dev_set(seed, n_queries=200, signed=True)
    assert_matches_pytrec(scores, labels, query_index)


def test_mrr_of_top_ranked_positive_with_negative_logit_is_one():
    metrics = ranking_metrics([-3.0, -0.5, -2.0], [0, 1, 0], [0, 0, 0])
    assert metrics["mrr@10"] == pytest.approx(1.0)


def test_hand_computed_example():
    # q0: positive at rank 2 of 3; q1: positive at rank 12 of 12 (outside the top 10)
    scores = [0.9, 0.5, 0.1] + [float(12 - i) for i in range(12)]
    labels = [0, 1, 0] + [0] * 11 + [1]
    query_index = [0] * 3 + [1] * 12
    metrics = ranking_metrics(scores, labels, query_index)

    assert metrics["mrr@10"] == pytest.approx((1 / 2 + 0) / 2)
    assert metrics["ndcg@10"] == pytest.approx((1 / math.log2(3) + 0) / 2)


def test_hand_computed_graded_gains_ties_and_a_query_without_relevant_documents():
    """Rows of three queries interleaved. Ties keep the candidate order as the dev metrics always counted it: of
    two equal scores the later row ranks first (the order the dev file's candidates were shuffled into)."""
    rows = [  # (query, score, gain)
        (0, 2.0, 0),
        (2, -1.0, 1),
        (0, 1.0, 3),
        (1, 1.0, 0),
        (0, 2.0, 1),  # ties with q0's first row, ranks above it
        (2, -1.0, 0),
        (1, 2.0, 0),  # q1: nothing relevant -> 0 for both metrics
        (0, 0.5, 0),
        (2, -1.0, 0),  # q2: three tied negative logits, the relevant row first -> ranked third
    ]
    metrics = ranking_metrics([s for _, s, _ in rows], [g for _, _, g in rows], [q for q, _, _ in rows])
    # q0 in rank order: gains 1, 0, 3, 0 (ideal 3, 1); q2: gains 0, 0, 1 (ideal 1)
    q0_ndcg = (1 / math.log2(2) + 3 / math.log2(4)) / (3 / math.log2(2) + 1 / math.log2(3))
    q2_ndcg = (1 / math.log2(4)) / 1
    assert metrics["ndcg@10"] == pytest.approx((q0_ndcg + 0 + q2_ndcg) / 3, abs=1e-12)
    assert metrics["mrr@10"] == pytest.approx((1 + 0 + 1 / 3) / 3, abs=1e-12)


def test_prefix_names_keys():
    assert set(ranking_metrics([1.0, 2.0], [1, 0], [0, 0], prefix="bm25_")) == {"bm25_ndcg@10", "bm25_mrr@10"}


def test_query_order_and_interleaving_do_not_matter():
    scores, labels, query_index = random_dev_set(5, n_queries=30, signed=False)
    rows = list(range(len(scores)))
    random.Random(0).shuffle(rows)
    shuffled = ranking_metrics([scores[r] for r in rows], [labels[r] for r in rows], [query_index[r] for r in rows])
    assert shuffled == pytest.approx(ranking_metrics(scores, labels, query_index))


def test_bm25_ranks_lexical_match_first():
    queries = {
        "lychee fruit sweetness": [
            "The lychee is a sweet tropical fruit with fragrant white flesh",
            "Diesel engines power most heavy trucks on highways",
            "Compilers translate source code into machine instructions",
            "The violin has four strings tuned in perfect fifths",
        ],
        "compiler machine code": [
            "Compilers translate source code into machine instructions",
            "The lychee is a sweet tropical fruit with fragrant white flesh",
            "Glaciers carve valleys over thousands of years",
            "Diesel engines power most heavy trucks on highways",
        ],
    }
    pairs = DevPairs([], [], [], [])
    for qi, (query, docs) in enumerate(queries.items()):
        for doc in reversed(docs):  # the match is not first in the input order
            pairs.query_index.append(qi)
            pairs.labels.append(int(doc == docs[0]))
            pairs.token_ids.append([])
            pairs.texts.append((query, doc))
    scores = bm25_scores(pairs)
    assert len(scores) == len(pairs.texts)
    for qi, docs in enumerate(queries.values()):
        mine = [(s, doc) for s, doc, q in zip(scores, [d for _, d in pairs.texts], pairs.query_index) if q == qi]
        best_score, best_doc = max(mine)
        assert best_doc == docs[0]
        assert best_score > 0 and sorted(s for s, _ in mine)[-2] < best_score
    metrics = ranking_metrics(scores, pairs.labels, pairs.query_index)
    assert metrics == pytest.approx({"ndcg@10": 1.0, "mrr@10": 1.0})
