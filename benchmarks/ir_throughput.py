"""Mining and reranking throughput on the built-in BEIR set, beside the in-loop dev evaluation's.

    python benchmarks/ir_throughput.py [--top-k 20] [--queries 20] [--batch 64] [--threads 2]

Prints: mining (BM25 first stage, cold cache then warm) in queries/s; `lychee_exp.rerank`'s scoring of the test
split's top-k in pairs/s; and the training loop's dev evaluation (core.evaluate.evaluate on the sample set's
fixed-candidate dev file) in pairs/s, with the same MiniLM preset, batch size and threads. A fresh cache
directory each run (LYCHEE_CACHE_DIR in a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--queries", type=int, default=20, help="test queries reranked / dev queries evaluated")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["LYCHEE_CACHE_DIR"] = tempfile.mkdtemp(prefix="lychee_ir_bench_")

    from lychee_exp.core.ir.mining import MineSettings
    from lychee_exp.core.ir.pipeline import mine_to_file, open_split

    dataset = "pkg://lychee_exp.assets/beir_sample"
    out = Path(os.environ["LYCHEE_CACHE_DIR"]) / "train.jsonl"
    for label in ("cold (index built)", "warm (index and run cached)"):
        start = time.perf_counter()
        corpus, split = open_split(dataset, "train")
        summary = mine_to_file(corpus, split, "bm25", MineSettings(), out, "none")
        seconds = time.perf_counter() - start
        rate = summary.written / seconds
        print(f"mine train, bm25, {label}: {summary.written} queries in {seconds:.2f} s = {rate:.0f} queries/s")

    rerank_pairs_per_s = _rerank(dataset, args)
    eval_pairs_per_s = _in_loop(args)
    print(f"rerank (lychee_exp.rerank's scoring): {rerank_pairs_per_s:.1f} pairs/s")
    print(f"in-loop dev evaluation (fixed candidates): {eval_pairs_per_s:.1f} pairs/s")
    print(f"rerank / in-loop: {rerank_pairs_per_s / eval_pairs_per_s:.2f}x")


def _rerank(dataset: str, args) -> float:
    from lychee_exp.core.distributed import DistEnv
    from lychee_exp.core.ir.config import RerankConfig, register_ir_schemas
    from lychee_exp.recipe import rerank as rerank_recipe
    from lychee_exp.run import command_config

    register_ir_schemas()
    overrides = [f"dataset={dataset}", "split=test", f"top_k={args.top_k}", "out=/tmp/unused", "progress_bar=false"]
    cfg = command_config("rerank", [*overrides, f"batch_size={args.batch}"], RerankConfig)
    original = rerank_recipe.open_split

    def first_queries(*a, **k):
        corpus, split = original(*a, **k)
        split.query_ids = split.query_ids[: args.queries]
        return corpus, split

    rerank_recipe.open_split = first_queries
    result = rerank_recipe.rerank_on_rank(cfg, DistEnv())
    return result["metrics"]["pairs_per_s"]


def _in_loop(args) -> float:
    from lychee_exp.core import evaluate as ev
    from lychee_exp.core.config import to_run_config
    from lychee_exp.core.data.groups import build_dev_pairs
    from lychee_exp.core.inputs import load_inputs
    from lychee_exp.core.model import load_reranker
    from lychee_exp.testing.jobs import compose_job

    overrides = [
        "data=sample",
        f"data.max_dev_queries={args.queries}",
        f"data.eval_batch_size={args.batch}",
        "logger=none",
    ]
    cfg = to_run_config(compose_job(overrides, "/tmp/lychee_ir_bench_run"))
    inputs = load_inputs(cfg)
    instruction = cfg.data.instruction or cfg.model.prompt.default_instruction
    pairs = build_dev_pairs(inputs.dev_queries, inputs.encoder, instruction, cfg.seed)
    model = load_reranker(cfg.model, inputs.encoder, cfg.seed)
    start = time.perf_counter()
    ev.evaluate(model, inputs.encoder, pairs, args.batch, torch.device("cpu"))
    return len(pairs.token_ids) / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
