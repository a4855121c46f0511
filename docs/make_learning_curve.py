"""Plots a run's learning curve: dev NDCG@10 by optimizer step, with BM25 and the teacher as reference lines.

    python docs/make_learning_curve.py outputs/runs/<run> [--png docs/beat_bm25_curve.png]

Reads the run's metrics.csv (dev/ndcg@10 rows) and metrics.json (bm25_ndcg@10, teacher_ndcg@10, initial_ndcg@10).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--png", type=Path, default=Path(__file__).resolve().parent / "beat_bm25_curve.png")
    ap.add_argument("--bm25", type=float, help="BM25 line, when the run has no metrics.json (yet)")
    ap.add_argument("--teacher", type=float, help="teacher line, when the run has no metrics.json (yet)")
    ap.add_argument("--title", default="experiment=beat_bm25: MiniLM cross-encoder, listwise + distillation")
    args = ap.parse_args(argv)
    with (args.run / "metrics.csv").open() as handle:
        points = [(int(r["step"]), float(r["dev/ndcg@10"])) for r in csv.DictReader(handle) if r.get("dev/ndcg@10")]
    summary = json.loads((args.run / "metrics.json").read_text()) if (args.run / "metrics.json").exists() else {}
    for key, value in (("bm25_ndcg@10", args.bm25), ("teacher_ndcg@10", args.teacher)):
        if value is not None:
            summary.setdefault(key, value)
    fig, ax = plt.subplots(figsize=(7, 4))
    if "initial_ndcg@10" in summary:
        points = [(0, summary["initial_ndcg@10"])] + [p for p in points if p[0] != 0]
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label="reranker (dev NDCG@10)")
    for key, label, style in (
        ("bm25_ndcg@10", "BM25", "--"),
        ("teacher_ndcg@10", "teacher (zero-shot bi-encoder)", ":"),
    ):
        if key in summary:
            ax.axhline(
                summary[key],
                linestyle=style,
                color="gray" if key.startswith("bm25") else "green",
                label=f"{label} {summary[key]:.3f}",
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("dev NDCG@10")
    ax.set_title(args.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"{len(points)} points -> {args.png}")


if __name__ == "__main__":
    main()
