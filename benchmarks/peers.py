"""Peer benchmark: lychee_exp against the loops a user would pick instead, on identical inputs, side by side.

    python -m benchmarks.peers [--mix longtail] [--precision fp32,bf16] [--steps 10] [--rounds 2] [--out D] [...]

Systems (see benchmarks.peer_loops): Hugging Face Trainer, a bare PyTorch loop, sentence-transformers'
CrossEncoderTrainer and FlagEmbedding's reranker trainer (benchmarks.flag_peer; these two on cross-encoder
models only), lychee_exp parallel=single (1 process x all threads), lychee_exp parallel=ddp (2 ranks x 1 thread),
lychee_exp on 1 process x 1 thread (the CPU speedup baseline), and lychee_exp with trainer.forward_chunks (pairs
of similar length forwarded together: less padding computed). All train the same model on the same batches (the
sample set with the MiniLM preset's prompt, 8 queries x 4 documents = 32 pairs, same truncation), fused AdamW
without weight decay (Trainer exempts biases and norms from it, the others do not), dropout 0; each runs in a
fresh process, systems interleaved in every round (the order rotates), and each step time is counted after the
same warm-up. `--mix longtail` (default: sample) trains the tiny Qwen2 on documents of 32-2048 tokens instead (a
long-tailed length mix), with and without `data.bucket_by_length` and forward chunks.
Every system runs in each precision of `--precision` (default both), a row each: fp32, or bf16 by its own switch
(the Trainers' `bf16=True`, the bare loop's autocast, lychee_exp's trainer.precision=bf16); a row's ratio to the
fastest peer is to the fastest peer of its own precision. `pip install -e .[bench]` installs the peers.
Writes peers.csv, peers.png and peers.md (a README table) into the output directory; the rest of the command line
is lychee_exp overrides (every system reads them).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import Column
from benchmarks.peer_batches import longtail_file
from lychee_exp.config.schema import LYCHEE_PREFIX
from lychee_exp.io.outputs import POLICY_LINE

log = logging.getLogger("benchmarks.peers")
# the names the benchmark writes into --out: an --out holding anything else is never replaced
WRITES = (r"peers\.(csv|md|png)", r"round\d+", r"longtail\.jsonl")

COLUMNS = [
    "system",
    "precision",
    "processes",
    "threads",
    "pairs_per_s",
    "tokens_per_s",
    "vs_fastest_peer",
    "padding_share",
    "peak_memory_mb",
    "rounds",
]
PEERS = ("hf_trainer", "torch_loop", "st_cross_encoder", "flag_embedding")
# What every system trains with (lychee_exp overrides; the peers read the same composed config), besides the
# run's trainer.precision
SETTINGS = [
    "data.train_group_size=4",
    "data.random_negatives=1",
    "model.dropout=0.0",
    "optimizer.lr=1e-4",
    "optimizer.lr_scaling=none",
    "optimizer.warmup_ratio=0",
    "optimizer.scheduler=linear",
    "optimizer.weight_decay=0.0",
    "optimizer.max_grad_norm=1.0",
    "loss=pointwise",
    "seed=42",
]
# the Lychee prompt's text as the cross-encoder's first text (prefix, instruction, query) and the document as its
# second, 160 tokens in all: issue 55's independent harness
LYCHEE_QUERY_SIDE = f"'{LYCHEE_PREFIX}\nInstruct: {{instruction}} Query: {{query}}'"
MIXES = {
    "sample": [
        "model=minilm_cross_encoder",
        "data=sample",
        "model.prompt.max_len=160",
        f"model.prompt.query_template={LYCHEE_QUERY_SIDE}",
    ],
    "longtail": [
        "model=tiny_lychee",
        "data=jsonl",
        "model.prompt.doc_max_len=2048",
        "data.train_group_size=4",
        "data.random_negatives=0",
    ],
}


def _system(name: str, processes: int, threads: int, *overrides: str) -> dict:
    return {"system": name, "processes": processes, "threads": threads, "overrides": list(overrides)}


def systems(mix: str, cores: int, cuda: int) -> list[dict]:
    """name, processes x threads, extra lychee_exp overrides (the lychee rows keep every other default)."""
    rows = [_system("hf_trainer", 1, cores), _system("torch_loop", 1, cores)]
    if mix == "sample":  # the cross-encoder peers (the longtail mix's tiny Qwen2 is a causal LM)
        rows += [_system("st_cross_encoder", 1, cores), _system("flag_embedding", 1, cores)]
    rows.append(_system("lychee_single", 1, cores, "parallel=single", "gpus=1"))
    if mix == "longtail":
        rows.append(
            _system("lychee_single_bucketed", 1, cores, "parallel=single", "gpus=1", "data.bucket_by_length=true")
        )
        return rows
    if cuda != 1:
        rows.append(_system("lychee_ddp", 2, 1, "parallel=ddp", "gpus=2", "parallel.cpu_threads_per_rank=1"))
    if not cuda:
        rows.append(
            _system("lychee_single_1thread", 1, 1, "parallel=single", "gpus=1", "parallel.cpu_threads_per_rank=1")
        )
    return rows


def child(name: str, spec: dict) -> dict:
    """One system's run, in this (fresh) process; returns its row."""
    out, warmup, steps = Path(spec["out"]), spec["warmup"], spec["steps"]
    overrides = [*spec["overrides"], f"data.batch_size={spec['queries'] // spec.get('processes', 1)}"]
    if name.startswith("lychee"):
        # as a user runs it (harness.lychee_run), training only; train_samples_per_s is lychee_exp's StepTimer: the
        # wall clock from the end of the last warm-up step to the end of the last step, everything between steps
        # included but checkpoint writes (the peers write none) - the same window and clock as timed_row below
        m = harness.lychee_run([*overrides, "trainer.evaluate=false", f"trainer.max_steps={warmup + steps}",
                                "logger=none"], out / "run")  # fmt: skip
        return {
            "pairs_per_s": m["train_samples_per_s"] * m["train_group_size"],
            "tokens_per_s": m["train_tokens_per_s"],
            "padding_share": m["padding_share"],
            "peak_memory_mb": max(m["peak_memory_mb_per_rank"]),
        }
    import torch

    from benchmarks import peer_loops as peers
    from benchmarks.peer_batches import build_steps

    torch.set_num_threads(spec["threads"])
    cfg, encoder, model, batches = build_steps(overrides, out, warmup + steps)
    settings = peers.Settings(
        cfg.optimizer.lr,
        cfg.optimizer.weight_decay,
        cfg.optimizer.max_grad_norm,
        cfg.seed,
        torch.device(spec["device"]),
        spec["precision"] == "bf16",
    )
    if name == "torch_loop":
        result = peers.torch_loop(model, batches, settings)
    elif name == "hf_trainer":
        result = peers.hf_trainer(model, batches, settings, encoder, str(out / "hf"))
    elif name == "flag_embedding":
        from benchmarks.flag_peer import identical_batches

        group = cfg.data.train_group_size
        result = identical_batches(model, batches, settings, encoder, group, str(out / "flag"))
    else:
        from lychee_exp.model.reranker import model_dir

        result = peers.st_cross_encoder(
            str(model_dir(cfg.model)), cfg.model.dropout, batches, settings, str(out / "st")
        )
    return peers.timed_row(result, batches, warmup, settings.device)


def measure(
    mix: str, precisions: list[str], overrides: list[str], out: Path, steps: int, rounds: int, queries: int
) -> list[dict]:
    import torch

    from lychee_exp.parallel.devices import available_cores, torch_device
    from lychee_exp.tracking.throughput import WARMUP_STEPS

    device = torch_device("cuda" if torch.cuda.is_available() else "cpu")  # cuda:0 where there is one
    cuda = torch.cuda.device_count() if device.type == "cuda" else 0
    base = [*SETTINGS, *MIXES[mix]]
    if mix == "longtail":
        data = longtail_file(out, queries * (WARMUP_STEPS + steps) * 2)
        base += [f"data.train_file={data}", f"data.dev_file={data}"]
    plan = {
        harness.run_name(s["system"], p): {**s, "precision": p}
        for p in precisions
        for s in systems(mix, available_cores(), cuda)
    }

    def run_one(name: str, round_: int) -> dict | None:
        s = plan[name]
        run_dir = out / f"round{round_}" / name.replace(":", "_")
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "out": str(run_dir),
            "warmup": WARMUP_STEPS,
            "steps": steps,
            "queries": queries,
            "threads": s["threads"],
            "processes": s["processes"],
            "device": str(device),
            "precision": s["precision"],
            # the run's precision last: it names the row, whatever the command line says
            "overrides": [*base, *s["overrides"], *overrides, f"trainer.precision={s['precision']}"],
        }
        return harness.run_child("benchmarks.peers", s["system"], spec, {"OMP_NUM_THREADS": str(s["threads"])})

    return summarize(list(plan.values()), harness.in_rounds(list(plan), rounds, run_one))


def summarize(plan: list[dict], results: dict[str, list[dict]]) -> list[dict]:
    """One row per system and precision that ran (results keyed by harness.run_name): the medians of its figures
    over rounds, and its ratio to the fastest peer of the same precision."""
    rows = [
        {
            "system": s["system"],
            "precision": s["precision"],
            "processes": s["processes"],
            "threads": s["threads"],
            "rounds": len(runs),
            **harness.medians(runs, list(runs[0])),
        }
        for s in plan
        if (runs := results[harness.run_name(s["system"], s["precision"])])
    ]
    harness.add_ratio_to_fastest(rows, PEERS)
    return rows


def write_outputs(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    harness.write_csv(out / "peers.csv", rows, COLUMNS)
    (out / "peers.md").write_text(markdown_table(rows) + "\n")
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.25 * len(rows)))  # a bar per system and precision
    colors = ["#dd8452" if r["system"].startswith("lychee") else "#4c72b0" for r in rows]
    ax.barh(
        [f"{r['system']} {r['precision']} ({r['processes']}x{r['threads']})" for r in rows],
        [r["tokens_per_s"] for r in rows],
        color=colors,
    )
    ax.set(xlabel="non-pad tokens/s (median over rounds)", title=title)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "peers.png", dpi=110)
    plt.close(fig)


TABLE = [
    harness.SYSTEM,
    harness.PRECISION,
    Column("processes x threads", lambda r: f"{r['processes']} x {r['threads']}"),
    harness.PAIRS_PER_S,
    harness.TOKENS_PER_S,
    harness.VS_FASTEST_PEER,
    harness.padding_column("padding"),
    Column("peak MB", lambda r: f"{r['peak_memory_mb']:.0f}"),
]


def markdown_table(rows: list[dict]) -> str:
    return harness.markdown_table(rows, TABLE)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if harness.child_call(argv, child):
        return 0
    harness.log_to_console()
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description="peer benchmark",
        usage=__doc__.strip().splitlines()[2],
        epilog=POLICY_LINE,
    )
    parser.add_argument(
        "--mix", choices=sorted(MIXES), default="sample", help="the data: the sample set, or long-tailed documents"
    )
    harness.add_precision_option(parser)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system (after warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds; each runs every system once")
    parser.add_argument("--queries", type=int, default=8, help="queries per step (x 4 documents)")
    harness.add_output_options(parser, "outputs/bench_peers/<time>_<mix>")
    args, overrides = parser.parse_known_args(argv)
    if args.out is None:
        args.out = harness.fresh_out("bench_peers", f"_{args.mix}")
    return harness.bench_main(lambda: benchmark(args, overrides), args.out)


def benchmark(args: argparse.Namespace, overrides: list[str]) -> int:
    with harness.bench_output(args.out, WRITES, args.overwrite) as staging:
        rows = measure(args.mix, args.precision, overrides, staging, args.steps, args.rounds, args.queries)
        if not rows:
            raise harness.NothingMeasured()
        write_outputs(rows, staging, f"{args.mix} mix, {args.queries} queries x 4 documents per step")
    out = Path(args.out)
    print(markdown_table(rows))
    print(f"wrote {out / 'peers.csv'}, {out / 'peers.png'} and {out / 'peers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
