"""Mining and reranking throughput on the built-in BEIR set, beside the in-loop dev evaluation's.

    python -m benchmarks.ir_throughput [--top-k 20] [--queries 20] [--batch 64] [--threads 2] [--bi-encoder]

Prints: mining (BM25 first stage, cold cache then warm) in queries/s; then, in pairs/s (scoring time only,
medians over rounds whose order rotates), `lychee_exp.rerank`'s scoring of the test split's top-k, the
training loop's dev evaluation (ir.evaluate.evaluate) on those same pairs, and on the sample set's
fixed-candidate dev file, with the same MiniLM preset, batch size and threads. `--bi-encoder` instead: side by
side on the test split's top-k pairs, the scoring of rerank and dev evaluation (ir.evaluate.score_sharded) with
model=minilm_bi_encoder (each distinct text encoded once) and sentence-transformers' (`SentenceTransformer(<the
same model>).encode` of each distinct query and document, then `similarity_pairwise` x 20), both fp32, with the
largest score difference. A fresh cache directory each run (LYCHEE_CACHE_DIR in a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, default=20, help="first-stage candidates reranked per query")
    parser.add_argument("--queries", type=int, default=20, help="test queries reranked / dev queries evaluated")
    parser.add_argument("--batch", type=int, default=64, help="pairs per forward pass")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every way (medians)")
    parser.add_argument("--bi-encoder", action="store_true", help="the bi-encoder against sentence-transformers only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["LYCHEE_CACHE_DIR"] = tempfile.mkdtemp(prefix="lychee_ir_bench_")
    if args.bi_encoder:
        return _bi_encoder_side_by_side("pkg://lychee_exp.assets/beir_sample", args)

    from lychee_exp.config.commands import MineConfig, mine_settings
    from lychee_exp.ir.pipeline import mine_to_file, open_split

    dataset = "pkg://lychee_exp.assets/beir_sample"
    out = Path(os.environ["LYCHEE_CACHE_DIR"]) / "train.jsonl"
    settings = mine_settings(MineConfig(dataset=dataset, out=str(out), teacher="none"))  # mine's defaults, BM25 alone
    for label in ("cold (index built)", "warm (index and run cached)"):
        start = time.perf_counter()
        corpus, split = open_split(dataset, "train")
        summary = mine_to_file(corpus, split, "bm25", settings, out, "none")
        seconds = time.perf_counter() - start
        rate = summary.written / seconds
        print(f"mine train, bm25, {label}: {summary.written} queries in {seconds:.2f} s = {rate:.0f} queries/s")

    ways = {
        "rerank": lambda: _rerank(dataset, args),
        "in-loop, same pairs": lambda: _in_loop_same_pairs(dataset, args),
        "in-loop, fixed candidates": lambda: _in_loop(args),
    }
    rates = harness.in_rounds(list(ways), args.rounds, lambda name, _: ways[name]())  # each way first in turn
    for name, values in rates.items():
        print(f"{name}: {statistics.median(values):.1f} pairs/s (rounds: {', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(rates["rerank"]) / statistics.median(rates["in-loop, same pairs"])
    print(f"rerank / in-loop on the same pairs: {ratio:.2f}x")


def _bi_encoder_side_by_side(dataset: str, args) -> None:
    """The bi-encoder's scoring here and sentence-transformers' on the same pairs, in rounds of both."""
    from sentence_transformers import SentenceTransformer

    from lychee_exp.cli import command_config
    from lychee_exp.config.commands import RerankConfig, register_ir_schemas
    from lychee_exp.ir.candidates import build_rerank_pairs
    from lychee_exp.ir.evaluate import score_token_ids
    from lychee_exp.ir.first_stage import retrieve
    from lychee_exp.ir.pipeline import open_split
    from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer, model_dir

    register_ir_schemas()
    cfg = command_config("rerank", [f"dataset={dataset}", "out=/tmp/unused", "model=minilm_bi_encoder"], RerankConfig)
    corpus, split = open_split(dataset, "test")
    split.query_ids = split.query_ids[: args.queries]
    run = retrieve("bm25", corpus, split, args.top_k)
    encoder = build_encoder(cfg.model, load_tokenizer(cfg.model))
    pairs = build_rerank_pairs(corpus, split, run, encoder, "", "bm25", args.top_k)
    model = load_reranker(cfg.model, encoder, cfg.seed)
    reference = SentenceTransformer(str(model_dir(cfg.model)), device="cpu")
    scores = {}

    def lychee() -> float:
        start = time.perf_counter()
        scores["lychee"] = torch.tensor(
            score_token_ids(model, encoder, pairs.token_ids, args.batch, torch.device("cpu"))
        )
        return len(pairs.texts) / (time.perf_counter() - start)

    def sentence_transformers() -> float:
        start = time.perf_counter()
        texts = list(dict.fromkeys(text for pair in pairs.texts for text in pair))  # each distinct text once
        vectors = reference.encode(texts, batch_size=args.batch, convert_to_tensor=True, show_progress_bar=False)
        row = {text: i for i, text in enumerate(texts)}
        queries, docs = (vectors[[row[text] for text in side]] for side in zip(*pairs.texts))
        scores["st"] = 20 * reference.similarity_pairwise(queries, docs).cpu()
        return len(pairs.texts) / (time.perf_counter() - start)

    ways = {"lychee_exp bi-encoder scoring": lychee, "sentence-transformers encode + similarity": sentence_transformers}
    rates = harness.in_rounds(list(ways), args.rounds, lambda name, _: ways[name]())
    print(f"bi-encoder, {len(pairs.texts)} pairs (test top-{args.top_k} of {args.queries} queries), fp32:")
    for name, values in rates.items():
        print(f"{name}: {statistics.median(values):.1f} pairs/s (rounds: {', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(rates["lychee_exp bi-encoder scoring"]) / statistics.median(
        rates["sentence-transformers encode + similarity"]
    )
    difference = float((scores["lychee"] - scores["st"]).abs().max())
    print(f"lychee_exp / sentence-transformers: {ratio:.2f}x; largest score difference {difference:.1e}")


def _rerank(dataset: str, args) -> float:
    from lychee_exp.cli import command_config
    from lychee_exp.config.commands import RerankConfig, register_ir_schemas
    from lychee_exp.ir import rank_reranking as rerank_recipe
    from lychee_exp.parallel.distributed import DistEnv

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
    return result["timing"]["pairs_per_s"]


def _in_loop_same_pairs(dataset: str, args) -> float:
    """The training loop's evaluate() on the rerank command's own pairs (the test split's first-stage top-k)."""
    from lychee_exp.cli import command_config
    from lychee_exp.config.commands import RerankConfig, register_ir_schemas
    from lychee_exp.ir import evaluate as ev
    from lychee_exp.ir.candidates import build_rerank_pairs
    from lychee_exp.ir.first_stage import retrieve
    from lychee_exp.ir.pipeline import open_split
    from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer

    register_ir_schemas()
    cfg = command_config("rerank", [f"dataset={dataset}", "out=/tmp/unused"], RerankConfig)
    corpus, split = open_split(dataset, "test")
    split.query_ids = split.query_ids[: args.queries]
    run = retrieve("bm25", corpus, split, args.top_k)
    encoder = build_encoder(cfg.model, load_tokenizer(cfg.model))
    instruction = cfg.model.prompt.default_instruction
    pairs = build_rerank_pairs(corpus, split, run, encoder, instruction, "bm25", args.top_k)
    model = load_reranker(cfg.model, encoder, cfg.seed)
    start = time.perf_counter()
    ev.evaluate(model, encoder, pairs, args.batch, torch.device("cpu"))
    return len(pairs.token_ids) / (time.perf_counter() - start)


def _in_loop(args) -> float:
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.data.groups import build_dev_pairs
    from lychee_exp.ir import evaluate as ev
    from lychee_exp.job.in_process import compose_job
    from lychee_exp.model.reranker import load_reranker
    from lychee_exp.train.inputs import load_inputs

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
