"""Scaling benchmark: how much faster is training on 2, 4, 8 devices than on one?

    python -m benchmarks gpus=1,2,4 [any run overrides, e.g. model=tiny_lychee] [--out DIR [--overwrite]]

Each device count (1 is always measured: speedup divides by it) trains the same model on the same data for a
few warm-up + timed steps (no evaluation), with DDP and the same per-device batch (weak scaling: the global
batch grows with the devices). On CPU ranks each rank gets ONE thread, so that one rank stands for one device.
Prints a table, writes bench.csv and bench.png into the output directory, and logs them to W&B (job_type=bench).
--out is written whole when the benchmark ends (docs/outputs.md): an earlier --out is replaced only with
--overwrite, and only when it holds nothing but this benchmark's results.
Timings are measured side by side in one invocation; nothing is asserted. Each device count's figure also goes
to the scaling cache that `hydra.sweeper.devices_per_trial=auto` reads (`scaling.json` next to
the speedup baselines, lychee_exp.sweep.placement.cache_path), so a sweep with the same settings calibrates nothing.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path

import torch

from benchmarks import harness
from lychee_exp.config.schema import to_run_config
from lychee_exp.errors import UserError
from lychee_exp.io.outputs import POLICY_LINE
from lychee_exp.job.in_process import compose_job, run_job
from lychee_exp.sweep.placement import store_rate
from lychee_exp.tracking.backends import make_logger

log = logging.getLogger("benchmarks.scaling")

COLUMNS = ["devices", "samples_per_s", "speedup", "efficiency", "data_wait_share", "rank_time_spread", "peak_memory_mb"]


# the names the benchmark writes into --out: an --out holding anything else is never replaced
WRITES = (r"bench\.csv", r"bench\.png", r"devices_\d+", "wandb")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, the default --out filled in, and the run overrides (gpus= among them, read by device_counts)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="DDP scaling benchmark",
        usage=__doc__.strip().splitlines()[2],
        epilog=POLICY_LINE,
    )
    harness.add_output_options(parser, "outputs/bench/<time>")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per device count (after 2 warm-up)")
    args, overrides = parser.parse_known_args(argv)
    args.out = harness.fresh_out("bench") if args.out is None else args.out
    return args, overrides


def device_counts(overrides: list[str]) -> tuple[list[int], list[str]]:
    """The device counts that gpus= lists (1 always among them), and the other overrides."""
    counts = [1, 2]
    rest = []
    for item in overrides:
        if item.startswith("gpus="):
            try:
                counts = sorted({int(n) for n in item.split("=", 1)[1].split(",")})
            except ValueError:
                raise UserError(f"{item}: expected a comma-separated list of device counts, e.g. gpus=1,2,4") from None
        else:
            rest.append(item)
    if not counts or min(counts) < 1:
        raise UserError("gpus: device counts must be >= 1")
    return sorted({1, *counts}), rest  # speedup divides by a measured 1-device run, never an assumed linear one


def timed_overrides(count: int, steps: int) -> list[str]:
    """One device count's timed run: DDP, one thread per rank, no evaluation, nothing saved or logged."""
    return [
        "parallel=ddp",
        f"gpus={count}",
        "parallel.cpu_threads_per_rank=1",
        "trainer.evaluate=false",
        f"trainer.max_steps={steps + 2}",
        "trainer.save_model=false",
        "trainer.checkpoint_every=0",
        "trainer.progress_bar=false",
        "logger=none",
        "trainer.measure_speedup=false",  # the rows themselves are the comparison
    ]


def measure(counts: list[int], overrides: list[str], out: Path, steps: int) -> list[dict]:
    rows = []
    for count in counts:
        timed = timed_overrides(count, steps)
        _, m = run_job([*overrides, *timed], out / f"devices_{count}")
        # the figure a sweep's devices_per_trial=auto would calibrate for these settings: it reuses it
        cfg = to_run_config(compose_job([*overrides, *timed], out / f"devices_{count}"))
        store_rate(cfg, "cuda" if torch.cuda.is_available() else "cpu", count, m["train_samples_per_s"], "bench")
        rows.append(
            {
                "devices": count,
                "samples_per_s": m["train_samples_per_s"],
                "data_wait_share": m["data_wait_share"],
                "rank_time_spread": m["rank_time_spread"],
                "peak_memory_mb": max(m["peak_memory_mb_per_rank"]),
            }
        )
    (base,) = [row["samples_per_s"] for row in rows if row["devices"] == 1]  # parse_args always adds 1 device
    for row in rows:
        row["speedup"] = row["samples_per_s"] / base
        row["efficiency"] = row["speedup"] / row["devices"]
    return rows


def write_outputs(rows: list[dict], out: Path) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv_path, png_path = out / "bench.csv", out / "bench.png"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: row[k] for k in COLUMNS} for row in rows)
    devices = [r["devices"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(
        range(len(devices)), [r["samples_per_s"] for r in rows], tick_label=[str(d) for d in devices], color="#4c72b0"
    )
    left.set(xlabel="devices", ylabel="train samples/s", title="Throughput")
    right.plot(devices, [r["speedup"] for r in rows], "o-", label="observed")
    right.plot(devices, devices, "--", color="grey", label="ideal (linear)")
    right.set(xlabel="devices", ylabel="speedup over 1 device", title="Speedup")
    right.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return csv_path, png_path


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'devices':>7} {'samples/s':>10} {'speedup':>8} {'efficiency':>10} {'data wait':>9} "
        f"{'rank spread':>11} {'peak MB':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['devices']:>7} {r['samples_per_s']:>10.2f} {r['speedup']:>7.2f}x {r['efficiency']:>9.0%} "
            f"{r['data_wait_share']:>9.1%} {r['rank_time_spread']:>11.2f} {r['peak_memory_mb']:>8.0f}"
        )
    return "\n".join(lines)


def log_to_wandb(rows: list[dict], overrides: list[str], out: Path, name: str) -> None:
    """The table and plot as a W&B run (job_type=bench) named for --out, its files in out (the staging
    directory: W&B's offline record moves into place with the rest)."""
    cfg = to_run_config(compose_job(overrides, out))
    if cfg.logger.name != "wandb":
        return
    logger = make_logger(
        cfg.logger,
        out,
        True,
        name=f"bench-{name}",
        group="bench",
        job_type="bench",
        config={
            "model": cfg.model.name,
            "per_device_batch_size": cfg.data.batch_size,
            "devices": [r["devices"] for r in rows],
            "overrides": overrides,
        },
    )
    logger.log_table("bench", COLUMNS, [[r[k] for k in COLUMNS] for r in rows], out / "bench.png")
    logger.log_summary({f"speedup_{r['devices']}": r["speedup"] for r in rows})
    logger.finish()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    return harness.bench_main(lambda: benchmark(args, overrides), args.out)


def benchmark(args: argparse.Namespace, overrides: list[str]) -> int:
    """Every check (gpus=, the config each device count composes, --out) before the first measurement; then the rows
    and the W&B record, all in the staging directory that becomes --out."""
    counts, overrides = device_counts(overrides)
    for count in counts:
        harness.checked_config([*overrides, *timed_overrides(count, args.steps)], args.out)
    with harness.bench_output(args.out, WRITES, args.overwrite) as staging:
        rows = measure(counts, overrides, staging, args.steps)
        write_outputs(rows, staging)
        log_to_wandb(rows, overrides, staging, Path(args.out).name)
    out = Path(args.out)
    print(format_table(rows))
    print(f"wrote {out / 'bench.csv'} and {out / 'bench.png'}")
    for record in sorted(out.glob("wandb/offline-run-*")):  # where W&B's own line said it was: the staging dir
        print(f"W&B run offline in {record}; upload it with: wandb sync {record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
