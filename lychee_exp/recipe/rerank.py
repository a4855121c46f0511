"""Reranking a BEIR split on one rank of a run: the split's first-stage top-k (cached by the command's
preflight), scored with a trained model or any preset, batched by length and sharded over the ranks
(core.evaluate.score_sharded); rank 0 returns the reranked run, the metrics and the throughput."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import torch
from tqdm import tqdm

from lychee_exp.core.distributed import DistEnv
from lychee_exp.core.evaluate import score_sharded
from lychee_exp.core.ir.candidates import build_rerank_pairs
from lychee_exp.core.ir.config import RerankConfig
from lychee_exp.core.ir.first_stage import retrieve
from lychee_exp.core.ir.metrics import trec_metrics
from lychee_exp.core.ir.pipeline import open_split
from lychee_exp.core.model import build_encoder, load_reranker, load_tokenizer
from lychee_exp.core.seeding import seed_everything

log = logging.getLogger(__name__)


def rerank_on_rank(cfg: RerankConfig, env: DistEnv) -> dict:
    corpus, split = open_split(cfg.dataset, cfg.split)
    first = retrieve(cfg.first_stage, corpus, split, cfg.top_k, cfg.dense, stemmer=cfg.bm25_stemmer)
    tokenizer = load_tokenizer(cfg.model)
    encoder = build_encoder(cfg.model, tokenizer)
    instruction = cfg.instruction or cfg.model.prompt.default_instruction
    pairs = build_rerank_pairs(corpus, split, first, encoder, instruction, "first_stage", cfg.top_k)
    seed_everything(cfg.seed, deterministic=True)
    model = load_reranker(cfg.model, encoder, cfg.seed).to(env.device)
    # bf16 autocast on GPUs that have it (the in-loop evaluation's precision=auto); the CPU scores in fp32
    autocast = contextlib.nullcontext
    if env.device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

        def autocast():
            return torch.autocast("cuda", dtype=dtype)

    show = env.is_main and cfg.progress_bar and sys.stderr.isatty()
    # rank 0's bar counts its own pairs times the ranks: every rank scores about as many
    bar = tqdm(total=len(pairs.token_ids), desc=f"rerank {cfg.split}", unit="pair", disable=not show)
    start = time.perf_counter()
    scores = score_sharded(
        model,
        encoder,
        pairs.token_ids,
        cfg.batch_size,
        env.device,
        env,
        autocast,
        lambda n: bar.update(n * env.world_size),
    )
    seconds = time.perf_counter() - start
    bar.close()
    if not env.is_main:
        return {}
    run = pairs.run_of(scores)
    metrics = trec_metrics(run, split.qrels, cfg.top_k)
    metrics.update(trec_metrics(first, split.qrels, cfg.top_k, prefix="first_stage_"))
    metrics.update(
        pairs=len(scores),
        queries=len(split.query_ids),
        ranks=env.world_size,
        scoring_s=seconds,
        pairs_per_s=len(scores) / seconds if seconds > 0 else 0.0,
        protocol=f"rerank the {cfg.first_stage} top-{cfg.top_k}, trec_eval metrics over every judged document",
    )
    return {"run": run, "metrics": metrics}
