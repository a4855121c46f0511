"""trec_eval metrics: NDCG@10 normalised over every judged relevant document (a relevant document the first stage
missed costs), graded gains, MRR@10 in trec_eval's order, and agreement with pytrec_eval read from a written run
file; the fixed-candidate protocol (the same code, with its own tie order) agrees with it when every relevant
document is a candidate."""

from __future__ import annotations

import math
import random

import pytest
import pytrec_eval

from lychee_exp.ir.evaluate import ranking_metrics
from lychee_exp.ir.metrics import trec_metrics
from lychee_exp.ir.trec import as_written, write_run


def _dcg(gains):
    return sum(g / math.log2(i + 2) for i, g in enumerate(gains))


def test_ndcg_counts_the_relevant_document_the_first_stage_missed_and_uses_grades():
    qrels = {"q": {"a": 2, "b": 1, "missed": 1, "judged_no": 0}}
    run = {"q": {"x": 3.0, "a": 2.0, "judged_no": 1.5, "b": 1.0}}
    got = trec_metrics(run, qrels, recall_at=100)
    expected = _dcg([0, 2, 0, 1]) / _dcg([2, 1, 1])  # the ideal ranking includes the missed document
    assert got["ndcg@10"] == pytest.approx(expected, abs=1e-12)
    assert got["ndcg@10"] < _dcg([0, 2, 0, 1]) / _dcg([2, 1])  # what normalising over retrieved only would give
    assert got["recall@100"] == pytest.approx(2 / 3)
    assert got["map"] == pytest.approx((1 / 2 + 2 / 4) / 3)  # precision at each relevant hit / all relevant
    assert got["mrr@10"] == pytest.approx(1 / 2)


def test_mrr_at_10_stops_at_rank_10_and_breaks_ties_as_trec_eval():
    qrels = {"q": {"rel": 1}}
    deep = {"q": {**{f"n{i:02d}": 10.0 - i * 0.1 for i in range(10)}, "rel": 0.0}}
    assert trec_metrics(deep, qrels)["mrr@10"] == 0.0
    tied = {"q": {"rel": 1.0, "zzz": 1.0}}  # trec_eval: equal scores by document id descending -> zzz first
    assert trec_metrics(tied, qrels)["mrr@10"] == 0.5
    evaluator = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"})
    assert evaluator.evaluate(tied)["q"]["recip_rank"] == 0.5


def test_metrics_equal_pytrec_eval_on_the_written_run_file(tmp_path):
    rng = random.Random(3)
    docs = [f"d{i}" for i in range(60)]
    qrels = {f"q{i}": {d: rng.choice([0, 1, 1, 2, 3]) for d in rng.sample(docs, 8)} for i in range(15)}
    # scores with ties and far more digits than a run file keeps; some relevant documents never retrieved
    run = {q: {d: round(rng.gauss(0, 1), rng.choice([1, 9])) for d in rng.sample(docs, 30)} for q in qrels}
    ours = trec_metrics(as_written(run), qrels, recall_at=20)
    write_run(tmp_path / "run.trec", run, "t")
    with (tmp_path / "run.trec").open() as handle:
        from_file = pytrec_eval.parse_run(handle)
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "map", "recall.20"}).evaluate(from_file)
    for ours_key, theirs in (("ndcg@10", "ndcg_cut_10"), ("map", "map"), ("recall@20", "recall_20")):
        assert ours[ours_key] == pytest.approx(sum(q[theirs] for q in per_query.values()) / len(per_query), abs=1e-12)
    top10 = {q: dict(sorted(d.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:10]) for q, d in from_file.items()}
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    assert ours["mrr@10"] == pytest.approx(sum(q["recip_rank"] for q in rr.values()) / len(rr), abs=1e-12)


def test_the_fixed_candidate_protocol_agrees_when_every_relevant_document_is_a_candidate():
    rng = random.Random(5)
    scores, labels, index, run, qrels = [], [], [], {}, {}
    for qi in range(10):
        gains = [rng.choice([1, 2, 3])] + [rng.choice([0, 0, 1]) for _ in range(14)]
        values = rng.sample(range(1000), len(gains))  # no ties: both orders are the score order
        q = f"q{qi}"
        run[q] = {f"d{j}": float(v) for j, v in enumerate(values)}
        qrels[q] = {f"d{j}": g for j, g in enumerate(gains)}
        scores += values
        labels += gains
        index += [qi] * len(gains)
    fixed = ranking_metrics(scores, labels, index)
    trec = trec_metrics(run, qrels)
    assert fixed["ndcg@10"] == pytest.approx(trec["ndcg@10"], abs=1e-6)
    assert fixed["mrr@10"] == pytest.approx(trec["mrr@10"], abs=1e-6)
