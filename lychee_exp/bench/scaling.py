"""Scaling benchmark: how much faster is training on 2, 4, 8 devices than on one?

    python -m lychee_exp.bench gpus=1,2,4 [any run overrides, e.g. model=tiny_lychee] [--out DIR]

Each device count (1 is always measured: speedup divides by it) trains the same model on the same data for a
few warm-up + timed steps (no evaluation), with DDP and the same per-device batch (weak scaling: the global
batch grows with the devices). On CPU ranks each rank gets ONE thread, so that one rank stands for one device.
Prints a table, writes bench.csv and bench.png into the output directory, and logs them to W&B (job_type=bench).
Timings are measured side by side in one invocation; nothing is asserted. Each device count's figure also goes
to the scaling cache that `hydra.sweeper.devices_per_trial=auto` reads (`scaling.json` next to
the speedup baselines, lychee_exp.tracking.speedup.scaling_file), so a sweep with the same settings calibrates nothing.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from datetime import datetime
from pathlib import Path

import torch

from lychee_exp.core.config import to_run_config
from lychee_exp.core.errors import RunFailed, UserError
from lychee_exp.sweep.placement import store_rate
from lychee_exp.testing.jobs import compose_job, run_job
from lychee_exp.tracking.backends import make_logger

log = logging.getLogger("lychee_exp.bench.scaling")

COLUMNS = ["devices", "samples_per_s", "speedup", "efficiency", "data_wait_share", "rank_time_spread", "peak_memory_mb"]


def parse_args(argv: list[str]) -> tuple[list[int], list[str], Path, int]:
    parser = argparse.ArgumentParser(description="DDP scaling benchmark", usage=__doc__.strip().splitlines()[2])
    parser.add_argument("--out", type=Path, default=None, help="output directory (default outputs/bench/<time>)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per device count (after 2 warm-up)")
    args, overrides = parser.parse_known_args(argv)
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
    counts = sorted({1, *counts})  # speedup divides by a measured 1-device run, never an assumed linear one
    out = args.out or Path("outputs/bench") / f"{datetime.now():%Y-%m-%d_%H-%M-%S}"
    return counts, rest, out, args.steps


def measure(counts: list[int], overrides: list[str], out: Path, steps: int) -> list[dict]:
    rows = []
    for count in counts:
        timed = [
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


def log_to_wandb(rows: list[dict], overrides: list[str], out: Path, png: Path) -> None:
    cfg = to_run_config(compose_job(overrides, out))
    if cfg.logger.name != "wandb":
        return
    logger = make_logger(
        cfg.logger,
        out,
        True,
        name=f"bench-{out.name}",
        group="bench",
        job_type="bench",
        config={
            "model": cfg.model.name,
            "per_device_batch_size": cfg.data.batch_size,
            "devices": [r["devices"] for r in rows],
            "overrides": overrides,
        },
    )
    logger.log_table("bench", COLUMNS, [[r[k] for k in COLUMNS] for r in rows], png)
    logger.log_summary({f"speedup_{r['devices']}": r["speedup"] for r in rows})
    logger.finish()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        counts, overrides, out, steps = parse_args(sys.argv[1:] if argv is None else argv)
        out.mkdir(parents=True, exist_ok=True)
        rows = measure(counts, overrides, out, steps)
    except (UserError, RunFailed) as err:
        log.error("error: %s", err)
        return 2 if isinstance(err, UserError) else 1
    csv_path, png_path = write_outputs(rows, out)
    print(format_table(rows))
    print(f"wrote {csv_path} and {png_path}")
    log_to_wandb(rows, overrides, out, png_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
