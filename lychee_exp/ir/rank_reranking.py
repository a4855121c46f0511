"""Reranking a BEIR split on one rank of a run: the split's first-stage top-k (cached by the command's
preflight), scored with a trained model or any preset, batched by length and sharded over the ranks
(ir.evaluate.score_sharded); rank 0 returns the reranked run, the metrics and per-query figures of it and of
the first stage (none for a split without qrels), the counts and the throughput."""

from __future__ import annotations

import logging
import time

from lychee_exp.config.commands import RerankConfig
from lychee_exp.io.progress import progress_shown
from lychee_exp.ir.candidates import build_rerank_pairs
from lychee_exp.ir.evaluate import score_sharded
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.fusion import fuse
from lychee_exp.ir.metrics import mean_metrics, per_query_metrics, per_query_tsv
from lychee_exp.ir.pipeline import dense_teacher, open_split
from lychee_exp.model.precision import autocast, resolve_precision
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer
from lychee_exp.parallel.distributed import DistEnv, seed_everything

log = logging.getLogger(__name__)


def rerank_on_rank(cfg: RerankConfig, env: DistEnv) -> dict:
    with progress_shown(cfg.progress_bar and env.is_main):  # the scoring's, and rank 0's dense encoding
        return _rerank_on_rank(cfg, env)


def _rerank_on_rank(cfg: RerankConfig, env: DistEnv) -> dict:
    corpus, split = open_split(cfg.dataset, cfg.split, need_qrels=False)
    first = retrieve(cfg.first_stage, corpus, split, cfg.top_k, cfg.dense, stemmer=cfg.bm25_stemmer)
    tokenizer = load_tokenizer(cfg.model)
    encoder = build_encoder(cfg.model, tokenizer)
    instruction = cfg.instruction or cfg.model.prompt.default_instruction
    pairs = build_rerank_pairs(corpus, split, first, encoder, instruction, "first_stage", cfg.top_k)
    seed_everything(cfg.seed, deterministic=True)
    model = load_reranker(cfg.model, encoder, cfg.seed).to(env.device)
    precision = resolve_precision(str(cfg.precision), env.device)

    def mixed_precision():
        return autocast(env.device.type, precision)

    start = time.perf_counter()
    scores = score_sharded(
        model, encoder, pairs.token_ids, cfg.batch_size, env.device, env, mixed_precision, f"rerank {cfg.split}"
    )
    seconds = time.perf_counter() - start
    if not env.is_main:
        return {}
    runs = {"": pairs.run_of(scores), "first_stage_": first}
    if cfg.teacher_figures:  # the teacher alone beside the model (rerank_command has set it for any mix)
        teacher = dense_teacher(corpus, split, cfg.dense, "dense.model")(list(zip(pairs.qids, pairs.doc_ids)))
        runs["teacher_"] = pairs.run_of(teacher)
    if cfg.teacher_weight or cfg.first_stage_weight:  # the run is a mix; the model alone beside it
        partners = [(pairs.first_stage_scores, cfg.first_stage_weight)]
        if cfg.teacher_weight:  # then teacher_figures is on: rerank_command sets it
            partners.append((teacher, cfg.teacher_weight))
        runs["model_"] = runs[""]
        runs[""] = pairs.run_of(fuse(scores, pairs.qids, partners))
    tables = {prefix: per_query_metrics(run, split.qrels, cfg.top_k) for prefix, run in runs.items()}
    metrics = {k: v for prefix, table in tables.items() for k, v in mean_metrics(table, prefix).items()}
    run = runs[""]
    counts = {
        "pairs": len(scores),
        "precision": precision,
        "ranks": env.world_size,
        "queries": len(split.query_ids),  # asked
        "queries_scored": sum(1 for docs in first.values() if docs),  # with at least one candidate
        "queries_judged": len(tables[""]),  # averaged over: a query without candidates counts 0
        "queries_without_relevant": sum(1 for q in tables[""] if not any(r > 0 for r in split.qrels[q].values())),
        "protocol": f"rerank the {cfg.first_stage} top-{cfg.top_k}, trec_eval -c metrics over every judged query",
    }
    timing = {"scoring_s": seconds, "pairs_per_s": len(scores) / seconds if seconds > 0 else 0.0}
    per_query = per_query_tsv(tables) if metrics else ""
    result = {"run": run, "metrics": metrics, "counts": counts, "timing": timing, "per_query": per_query}
    return {**result, "model_run": runs.get("model_")}
