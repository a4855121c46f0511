"""Builds docs/report.png: the local report (python -m lychee_exp.report) over SYNTHETIC example data — a small
lr x batch-size sweep of Lychee LoRA on 4 GPUs, single runs on 1/2/4/8 GPUs and a scaling benchmark, with
plausible numbers made up here (no training ran) — then screenshots it in headless Chromium.

    python docs/make_report_example.py [--data DIR] [--html FILE] [--png docs/report.png]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import tempfile
from pathlib import Path

import yaml

from lychee_exp.tracking.keys import TRIALS_CSV_COLUMNS
from lychee_exp.tracking.report.html import build, headless_chromium

HERE = Path(__file__).resolve().parent
rng = random.Random(7)
PER_GPU_SAMPLES_S = 23.5  # Qwen2.5-1.5B + LoRA, bf16, group size 16, one H100 (made up, plausible)
SCALING = {1: 1.0, 2: 1.93, 4: 3.71, 8: 6.94}


def write_run(run_dir: Path, *, gpus: int, batch: int, lr: float, ndcg: float, steps: int = 300) -> dict:
    run_dir.mkdir(parents=True)
    eff = batch * gpus
    speedup = SCALING[gpus] * rng.uniform(0.98, 1.02)
    history, loss = [], 0.69
    for step in range(10, steps + 1, 10):
        loss = 0.18 + (0.69 - 0.18) * math.exp(-step * lr * eff / 0.9) + rng.gauss(0, 0.012)
        history.append(
            {
                "step": step,
                "train/loss": loss,
                "train/lr": lr * min(1, step / 30),
                "train/grad_norm": rng.uniform(0.4, 1.6),
                "train/samples_per_s": PER_GPU_SAMPLES_S * speedup,
                "train/tokens_per_s": PER_GPU_SAMPLES_S * speedup * 16 * 240,
                "train/data_wait_share": rng.uniform(0.02, 0.05),
                "epoch": step // 150,
            }
        )
        if step % 100 == 0:
            history.append(
                {
                    "step": step,
                    "dev/ndcg@10": 0.52 + (ndcg - 0.52) * step / steps + rng.gauss(0, 0.004),
                    "dev/mrr@10": 0.47 + (ndcg - 0.52) * step / steps,
                }
            )
    metrics = {
        "ndcg@10": ndcg,
        "mrr@10": ndcg - 0.05,
        "initial_ndcg@10": 0.521,
        "initial_mrr@10": 0.468,
        "bm25_ndcg@10": 0.553,
        "bm25_mrr@10": 0.49,
        "train_loss": loss,
        "steps": steps,
        "effective_batch_size": eff,
        "per_device_batch_size": batch,
        "num_devices": gpus,
        "grad_accum_steps": 1,
        "lr": lr * eff / 16,
        "base_lr": lr,
        "precision": "bf16",
        "device": "cuda",
        "device_type": "cuda",
        "strategy": "ddp" if gpus > 1 else "single",
        "train_samples_per_s": PER_GPU_SAMPLES_S * speedup,
        "train_tokens_per_s": PER_GPU_SAMPLES_S * speedup * 3840,
        "data_wait_share": rng.uniform(0.02, 0.05),
        "rank_time_spread": rng.uniform(1.01, 1.08),
        "peak_memory_mb_per_rank": [round(9800 + 1450 * batch + rng.uniform(-90, 90)) for _ in range(gpus)],
        "train_time_s": steps * eff / (PER_GPU_SAMPLES_S * speedup),
        "eval_time_s": 41.0 / gpus,
        "speedup": speedup,
        "scaling_efficiency": speedup / gpus,
        "baseline_samples_per_s": PER_GPU_SAMPLES_S,
        "stopped_early": False,
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    columns = list(dict.fromkeys(k for row in history for k in row))
    with (run_dir / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(history)
    config = {
        "model": {"name": "lychee_rerank", "lora": {"enabled": True, "r": 64}},
        "loss": {"name": "pointwise"},
        "optimizer": {"lr": lr, "base_batch_size": 16, "lr_scaling": "linear"},
        "data": {"batch_size": batch, "train_group_size": 16},
        "gpus": gpus,
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return metrics


def make_data(root: Path) -> None:
    for gpus, ndcg in ((1, 0.688), (2, 0.691), (4, 0.694), (8, 0.686)):
        write_run(root / "runs" / f"lychee_lora_{gpus}gpu", gpus=gpus, batch=8, lr=1e-4, ndcg=ndcg)
    sweep = root / "sweeps" / "lr_batch_4gpu"
    trials = [
        (5e-5, 4, 0.671),
        (1e-4, 4, 0.689),
        (2e-4, 8, 0.702),
        (4e-4, 8, 0.664),
        (1e-4, 8, 0.695),
        (2e-4, 4, 0.684),
    ]
    rows = []
    for n, (lr, batch, ndcg) in enumerate(trials):
        m = write_run(sweep / str(n), gpus=4, batch=batch, lr=lr, ndcg=ndcg)
        rows.append(
            {
                "number": n,
                "state": "COMPLETE",
                "lr": lr,
                "per_device_batch_size": batch,
                "effective_batch_size": 4 * batch,
                "metric": round(ndcg, 4),
                "duration_s": round(m["train_time_s"] + 60, 1),
                "speedup": round(m["speedup"], 3),
                "scaling_efficiency": round(m["scaling_efficiency"], 3),
            }
        )
    rows.append(
        {
            "number": 6,
            "state": "FAIL",
            "lr": 4e-4,
            "per_device_batch_size": 16,
            "effective_batch_size": 64,
            "duration_s": 38.2,
            "reason": "rank 2: CUDA out of memory",
        }
    )
    with (sweep / "trials.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=TRIALS_CSV_COLUMNS, restval="")  # the sweeper's own columns
        writer.writeheader()
        writer.writerows(rows)
    summary = {
        "name": "lychee_optuna",
        "study_name": "lr_batch_4gpu",
        "metric": "ndcg@10",
        "direction": ["maximize"],
        "best_params": {"optimizer.lr": 2e-4, "data.batch_size": 8},
        "best_value": 0.702,
        "best_trial": 2,
        "n_trials": 7,
        "finished": 7,
        "complete": 6,
        "pruned": 0,
        "failed": 1,
    }
    (sweep / "optimization_results.yaml").write_text(yaml.safe_dump(summary, sort_keys=False))
    bench = root / "bench"
    bench.mkdir()
    with (bench / "bench.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["devices", "samples_per_s", "speedup", "efficiency", "data_wait_share", "rank_time_spread"])
        for d, s in SCALING.items():
            writer.writerow(
                [
                    d,
                    round(PER_GPU_SAMPLES_S * s, 2),
                    s,
                    round(s / d, 3),
                    round(0.02 + 0.004 * d, 3),
                    round(1.0 + 0.012 * d, 3),
                ]
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="write the example runs here (default: a temporary directory)")
    parser.add_argument("--html", type=Path, help="keep the report here")
    parser.add_argument("--png", type=Path, default=HERE / "report.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp) / "example"
        make_data(data)
        page = build(
            data,
            args.html or Path(tmp) / "report.html",
            title="lychee_exp report — EXAMPLE DATA (synthetic numbers, docs/make_report_example.py)",
        )
        proc = headless_chromium(page, f"--screenshot={args.png.resolve()}", "--window-size=1280,1600")
        if proc.returncode != 0 or not args.png.is_file():
            raise SystemExit(f"chromium failed: {proc.stderr.strip().splitlines()[-1:]}")
    print(args.png)


if __name__ == "__main__":
    main()
