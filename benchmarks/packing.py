"""Padded against packed batches (data.packing), side by side in one process: training tokens/s of the tiny Qwen2
on long-tailed documents (bench peers' longtail mix: 32-2048 tokens, median ~100).

    python benchmarks/packing.py [--steps 12] [--rounds 2] [--batch 8] [overrides]

Each variant is a fresh in-process Trainer (no evaluation, fp32, parallel=single) over the same data; variants run
in turns, `--rounds` times, and each row reports the median round. Throughput counts real (non-pad) tokens per
second after the trainer's warm-up steps; `padding_share` counts every slot computed (the packed row's rounding
pad included); `distinct_shapes` the input shapes the run forwarded. On a shared machine the absolute figures
move with the load; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from lychee_exp.bench.peers import MIXES, SETTINGS, longtail_file
from lychee_exp.core.config import to_run_config
from lychee_exp.core.devices import plan_devices
from lychee_exp.core.distributed import DistEnv
from lychee_exp.recipe.trainer import Trainer
from lychee_exp.testing.jobs import compose_job

VARIANTS = {
    "padded": [],
    "padded_bucketed_chunked": ["data.bucket_by_length=true", "trainer.forward_chunks=4"],
    "packed": ["data.packing=true"],
    "packed_bucketed": ["data.packing=true", "data.bucket_by_length=true"],
}
KEYS = ("train_tokens_per_s", "train_samples_per_s", "padding_share", "distinct_shapes", "train_loss")


def run_variant(overrides: list[str], out: Path) -> dict:
    cfg = to_run_config(compose_job([*overrides, "trainer.progress_bar=false", "speedup.calibrate=false"], out))
    plan = plan_devices("single", 1)
    torch.set_num_threads(plan.threads_per_rank)
    trainer = Trainer(cfg, DistEnv(), plan, out)
    trainer.setup()
    try:
        return trainer.fit()
    finally:
        trainer.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="queries per step (x 4 documents)")
    args, overrides = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="lychee-packing-"))
    data = longtail_file(out, args.batch * (args.steps + 2) * 2)
    base = [*SETTINGS, *MIXES["longtail"], f"data.train_file={data}", f"data.dev_file={data}"]
    base += ["parallel=single", "gpus=1", f"data.batch_size={args.batch}", f"trainer.max_steps={args.steps}"]
    base += ["trainer.evaluate=false", "logger=none", "trainer.save_model=false", *overrides]
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, extra in VARIANTS.items():
            results[name].append(run_variant([*base, *extra], out / f"{name}_{round_}"))
    print(f"{'variant':<26}" + "".join(f"{key:>20}" for key in KEYS))
    padded_rate = statistics.median(r["train_tokens_per_s"] for r in results["padded"])
    for name, runs in results.items():
        row = {key: statistics.median(r[key] for r in runs) for key in KEYS}
        cells = "".join(f"{row[key]:>20.4g}" for key in KEYS)
        print(f"{name:<26}{cells}   x{row['train_tokens_per_s'] / padded_rate:.2f} tokens/s of padded")
    threads = torch.get_num_threads()
    print(f"{args.steps} steps x {args.batch} queries x 4 documents, {threads} threads, {args.rounds} rounds")


if __name__ == "__main__":
    main()
