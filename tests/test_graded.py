"""Graded relevance: a dev file's pos_labels are NDCG gains (agreeing with trec_eval on graded qrels), MRR counts
any gain as relevant, and the gains reach the dev pairs the evaluation reads."""

from __future__ import annotations

import json
import random

import pytest
from conftest import TINY_QWEN2
from test_metrics import assert_matches_pytrec
from transformers import AutoTokenizer

from lychee_exp.config.schema import PromptConfig
from lychee_exp.data.groups import build_dev_pairs
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.data.queries import load_queries
from lychee_exp.ir.evaluate import ranking_metrics


def graded_dev_set(seed: int, n_queries: int):
    """Queries with 3-30 candidates, gains 0-3 (>= 1 relevant), distinct signed scores."""
    rng = random.Random(seed)
    scores, labels, query_index = [], [], []
    for qi in range(n_queries):
        n = rng.randint(3, 30)
        gains = [rng.choice([0, 0, 0, 1, 2, 3]) for _ in range(n)]
        if not any(gains):
            gains[rng.randrange(n)] = rng.randint(1, 3)
        for gain in gains:
            scores.append(rng.gauss(0.0, 3.0) + 1e-9 * len(scores))
            labels.append(gain)
            query_index.append(qi)
    return scores, labels, query_index


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_graded_ndcg_and_mrr_match_pytrec_eval(seed):
    assert_matches_pytrec(*graded_dev_set(seed, n_queries=150))


def test_gains_change_ndcg_not_mrr():
    # one query, three candidates ranked a > b > c; the gain-3 document at rank 2 vs at rank 1
    scores, query_index = [3.0, 2.0, 1.0], [0, 0, 0]
    low_first = ranking_metrics(scores, [1, 3, 0], query_index)
    high_first = ranking_metrics(scores, [3, 1, 0], query_index)
    assert low_first["mrr@10"] == high_first["mrr@10"] == 1.0
    assert high_first["ndcg@10"] == pytest.approx(1.0) and low_first["ndcg@10"] < 0.9


def test_pos_labels_reach_the_dev_pairs(tmp_path):
    path = tmp_path / "dev.jsonl"
    lines = [
        {"query": "q0", "pos": ["best", "good"], "neg": ["bad"], "pos_labels": [3, 1]},
        {"query": "q1", "pos": ["only"], "neg": ["n1", "n2"]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(TINY_QWEN2)), PromptConfig(), "left")
    pairs = build_dev_pairs(load_queries(str(path), "data.dev_file"), encoder, "instr", seed=0)
    gain = {(pairs.query_index[r], pairs.texts[r][1]): pairs.labels[r] for r in range(len(pairs.labels))}
    assert gain == {(0, "best"): 3, (0, "good"): 1, (0, "bad"): 0, (1, "only"): 1, (1, "n1"): 0, (1, "n2"): 0}
