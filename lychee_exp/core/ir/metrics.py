"""Ranking metrics as trec_eval computes them, through pytrec_eval (trec_eval's own code): NDCG@10 with graded
gains, normalised by the ideal DCG over every judged relevant document of the query (retrieved or not), MAP,
Recall@k, and MRR@10 (MS MARCO's: the reciprocal rank of the first relevant document in the top 10, in trec_eval's
order). Averaged over the queries that are both in the run and judged, as pytrec_eval and BEIR do."""

from __future__ import annotations

from lychee_exp.core.ir.trec import Run, ranked

MEASURES = {"ndcg_cut_10": "ndcg@10", "map": "map"}


def trec_metrics(run: Run, qrels: dict[str, dict[str, int]], recall_at: int = 100, prefix: str = "") -> dict:
    import pytrec_eval

    evaluator = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "map", f"recall.{recall_at}"})
    per_query = evaluator.evaluate(run)
    if not per_query:
        return {}
    names = {**MEASURES, f"recall_{recall_at}": f"recall@{recall_at}"}
    out = {
        f"{prefix}{name}": sum(q[measure] for q in per_query.values()) / len(per_query)
        for measure, name in names.items()
    }
    out[f"{prefix}mrr@10"] = sum(_reciprocal_rank(run[qid], qrels[qid]) for qid in per_query) / len(per_query)
    return out


def _reciprocal_rank(scores: dict[str, float], judged: dict[str, int], k: int = 10) -> float:
    for rank, (doc, _) in enumerate(ranked(scores)[:k], start=1):
        if judged.get(doc, 0) > 0:
            return 1.0 / rank
    return 0.0
