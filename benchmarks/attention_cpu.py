"""Attention alone on CPU, forward + backward: a packed row's prompts through sdpa one by one, the way
model.packed runs them (split views, float32 when gradients flow in bf16), against slicing each prompt out (the
earlier path) and against staying in bf16; and a forward alone (scoring) in bf16 against float32.

    python -m benchmarks.attention_cpu [--segments 32] [--lengths 64,96,128,160,256] [--repeats 10]

MiniLM's attention shape (12 heads of 32), every prompt of the given length, both ways (an encoder); the median of
`--repeats` timed passes after 3 warm-up passes, the paths one after the other at each length. This is the
measurement behind model.packed.float32_for_backward and per_prompt_attention.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from lychee_exp.model.packed import per_prompt_attention

HEADS, DIM = 12, 32
ENCODER = SimpleNamespace(is_causal=False, num_key_value_groups=1, training=True)  # what sdpa reads of a module


def sliced(q, k, v, bounds):
    """Each prompt sliced out of the row: the backward of every slice is a zero gradient of the whole row."""
    parts = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=2)


def ours(q, k, v, bounds):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return per_prompt_attention(sdpa_attention_forward, ENCODER, q, k, v, bounds, None, 0.0)


def ours_in_operand_dtype(q, k, v, bounds):
    """per_prompt_attention's split views, without its float32 upcast."""
    sizes = [e - s for s, e in zip(bounds, bounds[1:])]
    pieces = zip(*(t.split(sizes, dim=2) for t in (q, k, v)))
    return torch.cat([F.scaled_dot_product_attention(a, b, c) for a, b, c in pieces], dim=2)


def time_path(path, dtype, segments: int, length: int, repeats: int, backward: bool = True) -> float:
    """Median seconds of one forward (+ backward)."""
    gen = torch.Generator().manual_seed(0)
    width = segments * length
    q, k, v = (torch.randn(1, HEADS, width, DIM, generator=gen).to(dtype).requires_grad_(backward) for _ in "qkv")
    bounds = tuple(range(0, width + 1, length))
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = path(q, k, v, bounds)
            if backward:
                out.float().sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=32, help="prompts per packed row")
    parser.add_argument("--lengths", default="64,96,128,160,256", help="tokens per prompt to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes per length (the median is printed)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.segments} prompts, {HEADS}x{DIM}")
    print("forward + backward, ms:")
    print("| operands | tokens per prompt | sliced | split, operand dtype | lychee_exp | sliced / lychee_exp |")
    print("|---|---|---|---|---|---|")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for length in lengths:
            old = time_path(sliced, dtype, args.segments, length, args.repeats)
            split = time_path(ours_in_operand_dtype, dtype, args.segments, length, args.repeats)
            new = time_path(ours, dtype, args.segments, length, args.repeats)
            print(f"| {name} | {length} | {old * 1e3:.1f} | {split * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x |")
    print("\nforward alone (scoring), bf16 operands, ms:")
    print("| tokens per prompt | in bf16 | in float32 | float32 / bf16 |")
    print("|---|---|---|---|")
    for length in lengths:
        half = time_path(ours_in_operand_dtype, torch.bfloat16, args.segments, length, args.repeats, backward=False)
        full = time_path(
            lambda q, k, v, b: ours_in_operand_dtype(q.float(), k.float(), v.float(), b).bfloat16(),
            torch.bfloat16,
            args.segments,
            length,
            args.repeats,
            backward=False,
        )
        print(f"| {length} | {half * 1e3:.1f} | {full * 1e3:.1f} | {full / half:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
