"""Sweep throughput by device placement: the same sweep with `hydra.sweeper.devices_per_trial=all`, `1` and
`auto`, trials per hour side by side in one invocation.

    python -m benchmarks.sweep_throughput [--trials 8] [--out DIR [--overwrite]] [overrides]

Each setting runs the same study (`hparams_search=lr_batch`, the tiny Qwen2, `parallel=ddp` on every device the
machine has, the sampler's seed fixed, no pruning) from an empty sweep directory; `auto` starts with an empty
scaling cache, so its calibration (one short run per candidate device count, paid once per training settings)
is part of its wall time. Prints, per setting, the sweep command's wall time, trials per hour, the median trial
duration, auto's decision line, and whether auto chose the setting that measured faster. Extra arguments are
overrides for every sweep.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks import harness

# the same tiny sweep as the overhead benchmark
from benchmarks.sweep_overhead import TINY
from lychee_exp.io.outputs import POLICY_LINE

# the names the benchmark writes into --out: an --out holding anything else is never replaced
WRITES = (r"devices_per_trial_(all|1|auto)", "speedup_cache")


def sweep(out: Path, setting: str, trials: int, extra: list[str], cache: Path) -> dict:
    sweep_dir = out / f"devices_per_trial_{setting}"
    command = [sys.executable, "-m", "lychee_exp.run", "-m", "hparams_search=lr_batch", *TINY, *extra]
    command += [f"hydra.sweep.dir={sweep_dir}", f"hydra.sweeper.n_trials={trials}", "hydra.sweeper.sampler.seed=7"]
    command += [f"hydra.sweeper.devices_per_trial={setting}"]
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", LYCHEE_BASELINE_FILE=str(cache))
    began = time.monotonic()
    proc = subprocess.run(command, cwd=out, env=env, text=True, capture_output=True)
    wall = time.monotonic() - began
    if proc.returncode != 0:
        sys.exit(f"devices_per_trial={setting} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with (sweep_dir / "trials.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r["state"] == "COMPLETE"]
    summary = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    decision = next(
        (
            line.split("] ", 1)[-1]
            for line in (proc.stdout + proc.stderr).splitlines()
            if "x the trials per hour" in line
        ),
        "",
    )
    return {
        "setting": setting,
        "wall_s": wall,
        "complete": len(rows),
        "per_hour": len(rows) / wall * 3600,
        "median_trial_s": statistics.median(float(r["duration_s"]) for r in rows) if rows else float("nan"),
        "placement": summary.get("placement", {}),
        "decision": decision,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0], epilog=POLICY_LINE
    )
    parser.add_argument("--trials", type=int, default=8, help="trials per sweep")
    harness.add_output_options(parser, f"{tempfile.gettempdir()}/lychee-sweep-throughput/<time>")
    args, extra = parser.parse_known_args()
    if args.out is None:
        args.out = harness.fresh_out("lychee-sweep-throughput", root=tempfile.gettempdir())
    return harness.bench_main(lambda: compare(args, extra), args.out)


def compare(args: argparse.Namespace, extra: list[str]) -> None:
    with harness.bench_output(args.out, WRITES, args.overwrite) as staging:
        cache = staging / "speedup_cache" / "baselines.json"  # auto's scaling.json lands next to it: empty at first
        results = [sweep(staging, s, args.trials, extra, cache) for s in ("all", "1", "auto")]
    out = args.out
    print(f"\n{args.trials} trials of the tiny Qwen2 (lr_batch), {os.cpu_count()} cores; outputs in {out}")
    print(f"{'devices_per_trial':<18}{'wall s':>9}{'trials/h':>10}{'median trial s':>16}  placement")
    for r in results:
        placed = r["placement"]
        where = f"{placed.get('devices_per_trial', 'all')} device(s) x {placed.get('slots', 1)} slot(s)"
        row = f"{r['setting']:<18}{r['wall_s']:>9.1f}{r['per_hour']:>10.0f}{r['median_trial_s']:>16.1f}  {where}"
        print(row)
    auto = results[2]
    print(f"auto: {auto['decision'] or 'no decision line'}")
    faster = max(results[:2], key=lambda r: r["per_hour"])
    chosen = str(auto["placement"].get("devices_per_trial"))
    measured = "all" if faster["setting"] == "all" else "1"
    picked = "all" if chosen == str(auto["placement"].get("devices")) else chosen
    verdict = "auto picked the faster setting" if picked == measured else "auto did NOT pick the faster setting"
    print(f"auto chose {picked}; measured faster: devices_per_trial={measured} -> {verdict}")


if __name__ == "__main__":
    sys.exit(main())
