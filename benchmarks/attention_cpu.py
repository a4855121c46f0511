"""Attention alone on CPU: a packed row's segments through sdpa one by one (the per-prompt path) against one batched
matmul over the segments as padded rows (model.packed), forward + backward, in fp32 and bf16, by length.

    python -m benchmarks.attention_cpu [--segments 32] [--lengths 64,96,128,160,192,256] [--repeats 20]

MiniLM's attention shape (12 heads of 32), every segment of the given length, both ways (an encoder); the median
of `--repeats` timed passes after 3 warm-up passes, the two paths one after the other at each length. This is the
measurement behind segment_rows.MAX_SEGMENT_TOKENS and behind keeping sdpa in fp32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lychee_exp.model.packed import segment_rows_attention

HEADS, DIM = 12, 32


def per_segment(q, k, v, bounds):
    parts = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)


def matmul_rows(q, k, v, bounds):
    return segment_rows_attention(q, k, v, bounds, None, causal=False)


def time_path(path, dtype, segments: int, length: int, repeats: int) -> float:
    """Median seconds of one forward + backward."""
    gen = torch.Generator().manual_seed(0)
    width = segments * length
    q, k, v = (torch.randn(1, HEADS, width, DIM, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    bounds = tuple(range(0, width + 1, length))
    grad = torch.randn(1, width, HEADS, DIM, generator=gen).to(dtype)
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        path(q, k, v, bounds).backward(grad)
        if i >= 3:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=32, help="segments per packed row")
    parser.add_argument(
        "--lengths", default="64,96,128,160,192,256", help="segment lengths (tokens) to time, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed passes per length (the median is printed)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.segments} segments, {HEADS}x{DIM}")
    print("| precision | tokens per segment | sdpa per segment ms | segment rows ms | segment rows speedup |")
    print("|---|---|---|---|---|")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for length in (int(x) for x in args.lengths.split(",")):
            sdpa = time_path(per_segment, dtype, args.segments, length, args.repeats)
            rows = time_path(matmul_rows, dtype, args.segments, length, args.repeats)
            print(f"| {name} | {length} | {sdpa * 1e3:.2f} | {rows * 1e3:.2f} | {sdpa / rows:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
