"""Launches N tiny DDP runs back to back in ONE Python process and reports how many failed.

    python -m benchmarks.stress_launch --runs 50 --gpus 2

Each run starts fresh ranks with the elastic launcher, trains a few steps and tears down; a launcher that
leaks ports, process groups or signal handlers, or whose workers abort at exit, shows up as failures here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lychee_exp.job.in_process import run_job

TINY = [
    "experiment=tiny_smoke",
    "logger=none",
    "trainer.save_model=false",
    "trainer.eval_before_training=false",
    "trainer.max_steps=2",
    "data.max_dev_queries=4",
]


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="tiny DDP runs launched back to back")
    parser.add_argument("--gpus", type=int, default=2, help="ranks per run")
    args = parser.parse_args()
    failures, seconds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.runs):
            start = time.perf_counter()
            outcome = "ok"
            try:
                run_job([*TINY, "parallel=ddp", f"gpus={args.gpus}"], Path(tmp) / f"run{index}")
            except Exception as err:  # noqa: BLE001 - every failure counts, whatever its kind (RunFailed, ...)
                outcome = f"FAIL {type(err).__name__}: {err}"
                failures.append(f"run {index + 1}: {outcome}")
            seconds.append(time.perf_counter() - start)
            print(f"run {index + 1}/{args.runs}: {outcome} ({seconds[-1]:.1f} s)", flush=True)
    print(
        f"{args.runs} launches of {args.gpus} ranks: {len(failures)} failures; "
        f"median {statistics.median(seconds):.1f} s per run, max {max(seconds):.1f} s"
    )
    for failure in failures:
        print(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
