"""Per-trial overhead of a sweep, warm ranks against fresh ranks per trial, side by side.

    python benchmarks/sweep_overhead.py [--trials 6] [--gpus 2] [--repeats 2] [--out DIR] [overrides]

Runs the same sweep (`hparams_search=lr_batch`, the tiny Qwen2, `parallel=ddp gpus=N`, the sampler's seed fixed,
no pruning) with `parallel.warm_ranks=true` and with `false`, `--repeats` times each (at least 2), alternating
which goes first (fresh-warm, warm-fresh, ...) so that cold caches and the first start-up fall on both sides.
Prints each trial's overhead from trials.csv (duration - training - evaluation), the medians over all repeats,
and whether the warm and fresh trials got the same metrics. Extra arguments are overrides for every sweep (e.g.
`model=minilm_cross_encoder`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = [
    "model=tiny_lychee",
    "data.max_train_queries=16",
    "data.max_dev_queries=6",
    "data.train_group_size=4",
    "trainer.max_steps=4",
    "trainer.progress_bar=false",
    "trainer.precision=fp32",
    "trainer.save_model=false",
    "optimizer.lr_scaling=none",
    "logger=csv",
    "hydra.sweeper.pruner._target_=optuna.pruners.NopPruner",
    "~hydra.sweeper.pruner.n_startup_trials",
    "~hydra.sweeper.pruner.n_warmup_steps",
]
COMPARED = ("ndcg@10", "mrr@10", "train_loss", "steps")


def sweep(sweep_dir: Path, trials: int, gpus: int, warm: bool, overrides: list[str]) -> float:
    command = [
        sys.executable,
        "-m",
        "lychee_exp.run",
        "-m",
        "hparams_search=lr_batch",
        "parallel=ddp",
        f"gpus={gpus}",
        *TINY,
        f"parallel.warm_ranks={str(warm).lower()}",
        f"hydra.sweeper.n_trials={trials}",
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    if proc.returncode:
        sys.exit(f"the sweep in {sweep_dir} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return time.perf_counter() - start


def rows(sweep_dir: Path) -> list[dict]:
    with (sweep_dir / "trials.csv").open() as handle:
        return list(csv.DictReader(handle))


def outcome(run_dir: str) -> tuple:
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    return tuple(round(metrics[k], 6) for k in COMPARED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="sweeps per kind, order alternating (>= 2)")
    parser.add_argument("--out", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: the order alternates between repeats")
    out = args.out or Path(tempfile.mkdtemp(prefix="lychee-sweep-overhead-"))
    walls: dict[str, list[float]] = {"fresh": [], "warm": []}
    tables: dict[str, list[list[dict]]] = {"fresh": [], "warm": []}
    for repeat in range(args.repeats):
        order = (("fresh", False), ("warm", True)) if repeat % 2 == 0 else (("warm", True), ("fresh", False))
        for name, warm in order:
            sweep_dir = out / f"{repeat}-{name}"
            walls[name].append(sweep(sweep_dir, args.trials, args.gpus, warm, overrides))
            tables[name].append(rows(sweep_dir))
        print(f"repeat {repeat}: {' then '.join(name for name, _ in order)}")
    columns = ("rep", 3), ("trial", 5), ("fresh: overhead s", 18), ("warm: overhead s", 17), ("train+eval s", 13)
    print(" ".join(f"{name:>{width}}" for name, width in columns), "same metrics")
    same = []
    for repeat in range(args.repeats):
        for fresh, warm in zip(tables["fresh"][repeat], tables["warm"][repeat]):
            same.append(outcome(fresh["run_dir"]) == outcome(warm["run_dir"]))
            work = float(warm["train_time_s"]) + float(warm["eval_time_s"])
            print(
                f"{repeat:>3} {fresh['number']:>5} {fresh['overhead_s']:>18} {warm['overhead_s']:>17} {work:>13.2f} "
                f"{same[-1]}"
            )
    medians = {
        name: statistics.median(float(r["overhead_s"]) for table in per_repeat for r in table)
        for name, per_repeat in tables.items()
    }
    print(
        f"median overhead per trial over {args.repeats} repeats: fresh ranks {medians['fresh']:.2f} s, warm ranks "
        f"{medians['warm']:.2f} s ({medians['fresh'] / medians['warm']:.1f}x less); median sweep wall time "
        f"{statistics.median(walls['fresh']):.0f} s vs {statistics.median(walls['warm']):.0f} s; metrics equal in "
        f"{sum(same)}/{len(same)} trials; sweeps in {out}"
    )


if __name__ == "__main__":
    main()
