"""Ranking metrics as trec_eval computes them, through pytrec_eval (trec_eval's own code): NDCG@k with graded
gains, normalised by the ideal DCG over every judged relevant document of the query (retrieved or not), Recall@k,
at FlagEmbedding's evaluation cut-offs (1, 3, 5, 10, 100) and at the depth reranked, MAP, and MRR@10 (MS MARCO's:
the reciprocal rank of the first relevant document in the top 10, in trec_eval's order).

Averaged over every judged query the run asks (a run holds each query asked, those without candidates with none):
a query with no candidates, or judged with no relevant document, scores 0, as trec_eval -c and BEIR count them.
"""

from __future__ import annotations

from lychee_exp.config.choices import MIX, MODEL_PREFIX
from lychee_exp.ir.trec import Run, ranked

CUTOFFS = (1, 3, 5, 10, 100)  # FlagEmbedding's evaluation cut-offs

PerQuery = dict[str, dict[str, float]]  # query id -> measure name (ndcg@10, ...) -> value


def per_query_metrics(run: Run, qrels: dict[str, dict[str, int]], recall_at: int = 100) -> PerQuery:
    """Each judged query of the run, sorted by id: ndcg@k, recall@k, map, mrr@10 (0 where pytrec_eval has none)."""
    import pytrec_eval

    depths = ",".join(str(k) for k in sorted({*CUTOFFS, recall_at}))
    names = {f"ndcg_cut_{k}": f"ndcg@{k}" for k in CUTOFFS}
    names |= {f"recall_{k}": f"recall@{k}" for k in sorted({*CUTOFFS, recall_at})}
    names["map"] = "map"
    judged = sorted(qid for qid in run if qid in qrels)
    if not judged:
        return {}
    evaluator = pytrec_eval.RelevanceEvaluator(
        {q: qrels[q] for q in judged}, {f"ndcg_cut.{depths}", "map", f"recall.{depths}"}
    )
    evaluated = evaluator.evaluate({q: run[q] for q in judged})
    rows = {}
    for qid in judged:
        got = evaluated.get(qid, {})
        rows[qid] = {name: float(got.get(measure, 0.0)) for measure, name in names.items()}
        rows[qid]["mrr@10"] = _reciprocal_rank(run[qid], qrels[qid])
    return rows


def mean_metrics(rows: PerQuery, prefix: str = "") -> dict[str, float]:
    """Each measure averaged over the queries, summed in query id order (the same figure from any run order)."""
    if not rows:
        return {}
    names = next(iter(rows.values()))
    return {f"{prefix}{name}": sum(rows[q][name] for q in sorted(rows)) / len(rows) for name in names}


def trec_metrics(run: Run, qrels: dict[str, dict[str, int]], recall_at: int = 100, prefix: str = "") -> dict:
    return mean_metrics(per_query_metrics(run, qrels, recall_at), prefix)


def per_query_tsv(tables: dict[str, PerQuery]) -> str:
    """Several runs' per-query figures (prefix -> rows, over the same queries) as one TSV: a header (qid, then each
    measure with its run's prefix, the names of metrics.json), a row per query by id; values as Python prints a
    float, so each column averages to metrics.json's figure."""
    columns = [(prefix, name) for prefix, rows in tables.items() for name in next(iter(rows.values()), {})]
    qids = sorted({qid for rows in tables.values() for qid in rows})
    lines = ["\t".join(["qid", *(prefix + name for prefix, name in columns)])]
    lines += ["\t".join([qid, *(repr(tables[prefix][qid][name]) for prefix, name in columns)]) for qid in qids]
    return "\n".join(lines) + "\n"


def _reciprocal_rank(scores: dict[str, float], judged: dict[str, int], k: int = 10) -> float:
    for rank, (doc, _) in enumerate(ranked(scores)[:k], start=1):
        if judged.get(doc, 0) > 0:
            return 1.0 / rank
    return 0.0


def model_figure(metrics: dict, name: str = "ndcg@10") -> float | None:
    """The model's own figure. Runs written before every run logged model_* hold it unprefixed (they logged
    model_* only beside a mix)."""
    return metrics.get(MODEL_PREFIX + name, metrics.get(name))


def mix_figure(metrics: dict, name: str = "ndcg@10") -> float | None:
    """The mix's figure; None for a run ranked by the model alone. Runs written before `mix` was recorded were
    mixed exactly when they logged model_*."""
    mixed = metrics[MIX] if MIX in metrics else MODEL_PREFIX + name in metrics
    return metrics.get(name) if mixed else None


def named_figure(metrics: dict, name: str) -> float | None:
    """A dev figure by its metric name (optimized_metric, metric_for_best_model); a model_* name reads
    model_figure, so runs written before every run logged model_* give their model's figure too."""
    value = (
        model_figure(metrics, name.removeprefix(MODEL_PREFIX)) if name.startswith(MODEL_PREFIX) else metrics.get(name)
    )
    return None if value is None else float(value)


def standing_below_first_stage(metrics: dict, stage: str, split: str = "dev") -> str | None:
    """One line when the trained model alone ranks `split` below the first stage it reranks (a reranker that a
    user would be better off without), with the teacher beside them; None otherwise."""
    alone = model_figure(metrics)
    first = metrics.get(f"{stage}_ndcg@10")
    if alone is None or first is None or alone >= first:
        return None
    teacher = f", teacher {metrics['teacher_ndcg@10']:.4f}" if "teacher_ndcg@10" in metrics else ""
    return (
        f"the model alone ranks {split} below its first stage: ndcg@10 {alone:.4f} vs {stage} {first:.4f}{teacher} "
        "(train longer, or on harder negatives: docs/beir.md)"
    )
