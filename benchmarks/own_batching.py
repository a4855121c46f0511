"""Own-batching benchmark: every system reads the same JSONL file and batches it its own way, side by side.

    python -m benchmarks.own_batching [--precision fp32,bf16] [--steps 20] [--rounds 2] [--out DIR] [overrides]

Systems (benchmarks.own_batching_loops): Hugging Face Trainer, a bare PyTorch loop, sentence-transformers'
CrossEncoderTrainer, FlagEmbedding's reranker runner (benchmarks.flag_peer: its own group sampling and pair
tokenization of the file, its group cross-entropy loss), and `python -m lychee_exp.run parallel=single gpus=1`
with its defaults (only data.batch_size and data.train_group_size set so that it too takes 32 pairs a step, the
precision stated, and evaluation, the saved model and logging off), read from its metrics.json: the figure its user
reads. Same file (the built-in sample set), model (MiniLM cross-encoder, 1 logit,
lychee's dropout), prompt text ("Query: {query} Document: {document}", query cut to 24 tokens, document to 64),
threads (all cores), steps, lr (lychee's, scaled to its batch). Every system runs in each precision of
`--precision` (default both), a row each: fp32, or bf16 by its own switch (the Trainers' `bf16=True`, the bare
loop's autocast, lychee's trainer.precision=bf16); ratios to the fastest peer stay within a precision. Each run
is a fresh process, systems interleaved in every round; each peer is timed by the wall clock between step-end
stamps after the same warm-up, and its non-pad tokens are the attention-mask sums of what its model read (lychee's
StepTimer times the same window and counts the same tokens; checkpoint writes, which no peer makes, are off its
clock). Overrides on the command line (e.g. trainer.forward_chunks=1) go to lychee_single only, to try a setting
against the same peers (whose settings come from the defaults alone).
Writes own_batching.csv and own_batching.md into the output directory.
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import Column
from lychee_exp.io.outputs import POLICY_LINE

log = logging.getLogger("benchmarks.own_batching")
# the names the benchmark writes into --out: an --out holding anything else is never replaced
WRITES = (r"own_batching\.(csv|md)", r"round\d+")

PEERS = ("hf_trainer", "torch_loop", "st_cross_encoder", "flag_embedding")
SYSTEMS = (*PEERS, "lychee_single")
QUERIES, GROUP = 8, 4  # 32 pairs a step
COLUMNS = [
    "system",
    "precision",
    "pairs_per_s",
    "tokens_per_s",
    "vs_fastest_peer",
    "padding_share",
    "pairs_per_step",
    "timed_steps",
    "rounds",
    "own_metric_tokens_per_s",
]
# lychee_exp's defaults (`python -m lychee_exp.run`, checkpoints included), with only the batch shape (32 pairs) and
# the parts that are no training (evaluation, the saved model, logging) set; each run adds its trainer.precision
LYCHEE = [
    "parallel=single",
    "gpus=1",
    f"data.batch_size={QUERIES}",
    f"data.train_group_size={GROUP}",
    "trainer.evaluate=false",
    "trainer.save_model=false",
    "logger=none",
    # the prompt every peer reads (one templated string, the MiniLM preset's before it took text pairs), so that
    # docs/benchmarks_own_batching.md's figures stay comparable
    "model.prompt.text_pair=false",
    "model.prompt.prefix=''",
    "model.prompt.separator=''",
    "model.prompt.template='Query: {query} Document: {document}'",
    "model.prompt.max_len=0",
    "model.prompt.query_max_len=24",
    "model.prompt.doc_max_len=64",
]


def build_spec(out: Path, steps: int, threads: int, device: str, overrides: list[str]) -> dict:
    """What every system shares, read from lychee_exp's composed config."""
    from lychee_exp.config.auto import scaled_lr
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.io.user_files import resolve_path
    from lychee_exp.job.in_process import compose_job
    from lychee_exp.model.reranker import model_dir
    from lychee_exp.tracking.throughput import WARMUP_STEPS

    cfg = to_run_config(compose_job(LYCHEE, out))  # the shared settings: lychee's defaults, not the extra overrides
    path = model_dir(cfg.model)
    dropout = {}
    if cfg.model.dropout is not None:  # the same dropout as lychee's load_reranker sets
        from transformers import AutoConfig

        dropout = {
            k: cfg.model.dropout
            for k, v in AutoConfig.from_pretrained(str(path)).to_dict().items()
            if "dropout" in k and isinstance(v, float)
        }
    max_steps = WARMUP_STEPS + steps
    return {
        "train_file": str(resolve_path(cfg.data.train_file, "data.train_file")),
        "model_path": str(path),
        "template": cfg.model.prompt.prefix + cfg.model.prompt.separator + cfg.model.prompt.template,
        "query_max_len": cfg.model.prompt.query_max_len,
        "doc_max_len": cfg.model.prompt.doc_max_len,
        "dropout": dropout,
        "lr": scaled_lr(cfg, 1),
        "weight_decay": cfg.optimizer.weight_decay,
        "warmup_ratio": cfg.optimizer.warmup_ratio,
        "max_grad_norm": cfg.optimizer.max_grad_norm,
        "seed": cfg.seed,
        "pairs_per_step": QUERIES * GROUP,
        "warmup": WARMUP_STEPS,
        "max_steps": max_steps,
        "threads": threads,
        "device": device,
        "lychee_overrides": [*LYCHEE, *overrides, f"trainer.max_steps={max_steps}"],
    }


def child(name: str, spec: dict) -> dict:
    """One system's run, in this (fresh) process, in spec["out"]; returns its row's figures."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks import own_batching_loops as systems

    if name == "lychee_single":  # as a user runs it; its row is what its metrics.json says
        m = harness.lychee_run(spec["lychee_overrides"], Path(spec["out"]) / "run")
        return {
            "pairs_per_s": m["train_samples_per_s"] * GROUP,
            "tokens_per_s": m["train_tokens_per_s"],
            "padding_share": m["padding_share"],
            "pairs_per_step": [QUERIES * GROUP],  # data.batch_size queries x data.train_group_size, every step
            "timed_steps": m["steps"] - spec["warmup"],
            "own_metric_tokens_per_s": m["train_tokens_per_s"],
            "threads": m["cpu_threads_per_rank"],
        }
    torch.set_num_threads(spec["threads"])
    systems.METER.install(spec["model_path"])
    if name == "flag_embedding":  # reads the file itself
        from benchmarks.flag_peer import own_file

        own_file(spec, spec["out"])
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
        pairs = systems.read_pairs(Path(spec["train_file"]), tokenizer, spec["query_max_len"], spec["doc_max_len"])
        getattr(systems, name)(spec, pairs, spec["out"])
    w = systems.METER.window(spec["warmup"])
    return {
        "pairs_per_s": w["pairs"] / w["seconds"],
        "tokens_per_s": w["tokens"] / w["seconds"],
        "padding_share": 1 - w["tokens"] / w["slots"],
        "pairs_per_step": w["pairs_per_step"],
        "timed_steps": w["steps"],
        "own_metric_tokens_per_s": float("nan"),
    }


def measure(out: Path, precisions: list[str], steps: int, rounds: int, overrides: list[str]) -> list[dict]:
    import torch

    from lychee_exp.parallel.devices import available_cores

    threads = available_cores()
    spec = build_spec(out, steps, threads, "cuda" if torch.cuda.is_available() else "cpu", overrides)
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}

    def run_one(name: str, round_: int) -> dict | None:
        system, precision = harness.split_run_name(name)
        run_dir = out / f"round{round_}" / name.replace(":", "_")
        run_dir.mkdir(parents=True, exist_ok=True)
        # the run's precision after the command line's overrides: it names the row
        lychee = [*spec["lychee_overrides"], f"trainer.precision={precision}"]
        run = {**spec, "out": str(run_dir), "precision": precision, "lychee_overrides": lychee}
        return harness.run_child("benchmarks.own_batching", system, run, env)

    names = [harness.run_name(system, p) for p in precisions for system in SYSTEMS]
    return summarize(harness.in_rounds(names, rounds, run_one))


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    """One row per system and precision (results keyed by harness.run_name): medians over rounds; pairs_per_step
    as the distinct counts seen over every timed step of every round."""
    rows = []
    for name, runs in results.items():
        if runs:
            med = harness.medians(runs, ("pairs_per_s", "tokens_per_s", "padding_share", "own_metric_tokens_per_s"))
            system, precision = harness.split_run_name(name)
            rows.append(
                {
                    "system": system,
                    "precision": precision,
                    **med,
                    "pairs_per_step": "/".join(str(n) for n in sorted({n for r in runs for n in r["pairs_per_step"]})),
                    "timed_steps": min(r["timed_steps"] for r in runs),
                    "rounds": len(runs),
                }
            )
    harness.add_ratio_to_fastest(rows, PEERS)
    return rows


TABLE = [
    harness.SYSTEM,
    harness.PRECISION,
    harness.PAIRS_PER_S,
    harness.TOKENS_PER_S,
    harness.VS_FASTEST_PEER,
    harness.padding_column("padding share"),
    Column("pairs per step", lambda r: str(r["pairs_per_step"])),
]


def write_outputs(rows: list[dict], out: Path, header: str) -> None:
    harness.write_csv(out / "own_batching.csv", rows, COLUMNS)
    (out / "own_batching.md").write_text(f"{header}\n\n{harness.markdown_table(rows, TABLE)}\n")


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if harness.child_call(argv, child):
        return 0
    harness.log_to_console()
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description="own-batching benchmark",
        usage=__doc__.strip().splitlines()[2],
        epilog=POLICY_LINE,
    )
    harness.add_precision_option(parser)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system (after warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every system once")
    harness.add_output_options(parser, "outputs/bench_own_batching/<time>")
    parser.add_argument("overrides", nargs="*", help="more lychee_exp overrides, for lychee_single only")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    if args.out is None:
        args.out = harness.fresh_out("bench_own_batching")
    return harness.bench_main(lambda: benchmark(args), args.out)


def benchmark(args: argparse.Namespace) -> int:
    started, load_before = datetime.now(timezone.utc), _load()
    with harness.bench_output(args.out, WRITES, args.overwrite) as staging:
        rows = measure(staging, args.precision, args.steps, args.rounds, args.overrides)
        if not rows:
            raise harness.NothingMeasured()
        header = (
            f"{started:%Y-%m-%d %H:%M} UTC, {args.steps} timed steps x {args.rounds} rounds, {QUERIES * GROUP} pairs "
            f"per step; /proc/loadavg before: {load_before}, after: {_load()}"
            + (f"; lychee_single overrides: {' '.join(args.overrides)}" if args.overrides else "")
        )
        write_outputs(rows, staging, header)
    out = Path(args.out)
    print(header)
    print(harness.markdown_table(rows, TABLE))
    print(f"wrote {out / 'own_batching.csv'} and {out / 'own_batching.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
