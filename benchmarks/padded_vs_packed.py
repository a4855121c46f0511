"""Padded against packed batches (data.packing), side by side in one process: training tokens/s of the tiny Qwen2
on long-tailed documents (bench peers' longtail mix: 32-2048 tokens, median ~100).

    python -m benchmarks.padded_vs_packed [--steps 12] [--rounds 2] [--batch 8] [--threads 1] [--budget N]
                                                [overrides]

Each variant is a fresh in-process Trainer (no evaluation, fp32, parallel=single) over the same data; variants run
in turns, `--rounds` times. Each row reports its fastest round's wall-time tokens/s and its median round's tokens per
CPU-second (the process's CPU time, all threads, over the same steps): on a machine shared with other jobs both are
less disturbed than a single wall-time figure; the other columns are the same in every round. Throughput
counts real (non-pad) tokens per second after the trainer's warm-up steps; `padding_share` counts every slot
computed (the packed row's rounding pad included); `distinct_shapes` the input shapes the run forwarded.
The packed_budget rows batch by tokens (data.max_tokens_per_batch, `--budget`, by default the smallest multiple
of 512 that holds the data's longest group) instead of `--batch` queries; `tokens_per_step` is real tokens per
timed step, `largest_forward` the most token slots one forward held (what bounds activation memory on a GPU)
and `peak_memory_mb` the process's peak resident memory during that variant.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.peer_batches import longtail_file
from benchmarks.peers import MIXES, SETTINGS
from lychee_exp.config.schema import to_run_config
from lychee_exp.data.budget import first_epoch_sizes
from lychee_exp.job.in_process import compose_job
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.tracking.throughput import reset_peak_memory
from lychee_exp.train.inputs import load_inputs
from lychee_exp.train.trainer import Trainer

VARIANTS = {
    "padded": [],
    "padded_bucketed_chunked": ["data.bucket_by_length=true", "trainer.forward_chunks=4"],
    "packed": ["data.packing=true"],
    "packed_bucketed": ["data.packing=true", "data.bucket_by_length=true"],
    # data.max_tokens_per_batch: whole groups up to a token budget, every row exactly the budget wide
    "packed_budget": ["data.packing=true", "data.max_tokens_per_batch={budget}"],
    "packed_budget_bucketed": ["data.packing=true", "data.max_tokens_per_batch={budget}", "data.bucket_by_length=true"],
}
KEYS = (
    "train_tokens_per_s",
    "tokens_per_cpu_s",
    "padding_share",
    "distinct_shapes",
    "tokens_per_step",
    "largest_forward",
    "peak_memory_mb",
    "train_loss",
)


def run_variant(overrides: list[str], out: Path, threads: int) -> dict:
    """The run's metrics plus `tokens_per_cpu_s`: real tokens per second of this process's CPU time (all its
    threads) over the timed steps, which other jobs on the machine disturb far less than wall time."""
    cfg = to_run_config(compose_job([*overrides, "trainer.progress_bar=false", "trainer.measure_speedup=false"], out))
    plan = plan_devices("single", 1, cpu_threads_per_rank=threads)
    torch.set_num_threads(plan.threads_per_rank)
    reset_peak_memory(torch.device("cpu"))  # each variant's own peak (this process runs them all)
    trainer = Trainer(cfg, DistEnv(), plan, out)
    trainer.setup()
    cpu = 0.0
    train_window = trainer._train_window

    def timed_window(batches, first: int, micro_steps: int, step: int) -> None:
        nonlocal cpu
        start = time.process_time()
        train_window(batches, first, micro_steps, step)
        if step > trainer.timer.timed_from:  # the steps StepTimer times
            cpu += time.process_time() - start

    trainer._train_window = timed_window
    try:
        summary = trainer.fit()
    finally:
        trainer.cleanup()
    timed = trainer.timer.sums
    return {
        **summary,
        "tokens_per_cpu_s": timed["tokens"] / cpu if cpu else 0.0,
        "tokens_per_step": timed["tokens"] / max(1, summary["steps"] - trainer.timer.timed_from),
        "peak_memory_mb": max(summary["peak_memory_mb_per_rank"]),
        # the largest forward (rows x width slots): what bounds activation memory on a GPU
        "largest_forward": max(rows * width for rows, width in trainer.step.shapes),
    }


def smallest_budget(overrides: list[str], out: Path) -> int:
    """The smallest budget that holds every group of the data (rounded up to 512): the tightest setting."""
    cfg = to_run_config(compose_job(overrides, out))
    sizes, _ = first_epoch_sizes(cfg, load_inputs(cfg))
    return -(-max(tokens for tokens, _ in sizes) // 512) * 512


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per variant")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant, in turns")
    parser.add_argument("--batch", type=int, default=8, help="queries per step (x 4 documents)")
    # one thread: CPU time is then the step's own work, without other threads' spin-waits on a busy machine
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--budget", type=int, default=0, help="data.max_tokens_per_batch; 0 = the smallest that fits")
    args, overrides = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="lychee-packing-"))
    data = longtail_file(out, args.batch * (args.steps + 2) * 2)
    base = [*SETTINGS, *MIXES["longtail"], f"data.train_file={data}", f"data.dev_file={data}"]
    base += ["parallel=single", "gpus=1", f"data.batch_size={args.batch}", f"trainer.max_steps={args.steps}"]
    base += ["trainer.evaluate=false", "logger=none", "trainer.save_model=false", *overrides]
    budget = args.budget or smallest_budget(base, out / "budget")
    variants = {name: [o.format(budget=budget) for o in extra] for name, extra in VARIANTS.items()}
    # the process's first run pays one-time set-up (kernel selection, allocator growth): a short one, not counted
    run_variant([*base, "trainer.max_steps=3"], out / "warm-up", args.threads)

    def run_one(name: str, round_: int) -> dict:
        return run_variant([*base, *variants[name]], out / f"{name}_{round_}", args.threads)

    results = harness.in_rounds(list(variants), args.rounds, run_one)
    print(f"{'variant':<26}" + "".join(f"{key:>20}" for key in KEYS))
    best = {name: max(runs, key=lambda r: r["train_tokens_per_s"]) for name, runs in results.items()}
    padded_rate = best["padded"]["train_tokens_per_s"]
    cpu_padded = statistics.median(r["tokens_per_cpu_s"] for r in results["padded"])
    for name, row in best.items():
        row = {**row, "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in results[name])}
        cells = "".join(f"{row[key]:>20.4g}" for key in KEYS)
        rounds = " ".join(f"{r['train_tokens_per_s']:.0f}" for r in results[name])
        ratios = f"x{row['train_tokens_per_s'] / padded_rate:.2f} / x{row['tokens_per_cpu_s'] / cpu_padded:.2f}"
        print(f"{name:<26}{cells}   {ratios} of padded (wall rounds: {rounds})")
    threads = torch.get_num_threads()
    print(f"{args.steps} steps x {args.batch} queries x 4 documents, {threads} threads, {args.rounds} rounds")
    print(f"packed_budget*: data.max_tokens_per_batch={budget} (whole groups per step instead of {args.batch} queries)")


if __name__ == "__main__":
    main()
