"""The answer head alone, full-vocabulary projection against the two yes/no rows (model.answer_head), one run.

    python -m benchmarks.yes_no_head [--rows 32] [--repeats 5] [--threads 1] [--shapes tiny,1.5b]

A step: hidden states (rows, hidden) that need a gradient -> the relevance logit (yes - no) -> backward from a
fixed gradient of the loss with respect to the logit (the head alone, no loss). The full path is F.linear onto the
whole LM head, then the two columns (model.answer_head.full_answer: what `logits_to_keep` gave); the two-row path is
answer_row_logit. Shapes: the tiny Qwen2's (lychee_exp/assets/tiny_qwen2: hidden 64, vocab 4097) and
Qwen2.5-1.5B's (benchmarks/gpu/flops.py QWEN25_1P5B: hidden 1536, vocab 151936), the weight random (no download). The
head frozen (as under LoRA) or trainable (full fine-tuning: its dense weight gradient is set to None between steps,
as zero_grad does). fp32, or bf16: weight and hidden states in bf16 under bf16 autocast (the 1.5B check's
loading); the two-row path computes its one row in fp32 either way.

`ms`: the median step time (`--repeats` steps, more for sub-millisecond steps: about a second's worth), after a
discarded 3 s of tiny steps and two warm-up steps of each path; the two paths' steps alternate. `peak MiB`: the
most bytes of tensors the step created that were alive at once (the weight and the inputs excluded, views of them
too), read by a dispatch mode after every op of one separate step: what the step asks of the allocator, the same
on a loaded machine; not the process's resident memory (glibc keeps freed pages, other jobs share the machine).
Ratios: full / two rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.gpu.flops import QWEN25_1P5B
from lychee_exp.model.answer_head import answer_row_logit, full_answer

TINY_CONFIG = Path(__file__).resolve().parents[1] / "lychee_exp" / "assets" / "tiny_qwen2" / "config.json"
YES, NO = 9454, 2152  # any two distinct rows below both vocabularies' sizes would do
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PATHS = ("full", "two_rows")


def shapes() -> dict[str, tuple[int, int]]:
    tiny = json.loads(TINY_CONFIG.read_text())
    return {
        "tiny": (tiny["hidden_size"], tiny["vocab_size"]),
        "1.5b": (QWEN25_1P5B["hidden_size"], QWEN25_1P5B["vocab_size"]),
    }


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created under it that are alive at once, read after every op; storages of
    `existing` tensors (the weight, the inputs) are not counted, even when an op returns a view of them."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.skip = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                ref = StorageWeakRef(tensor.untyped_storage())
                if ref.cdata not in self.skip:
                    self.storages.setdefault(ref.cdata, (ref, tensor.untyped_storage().nbytes()))
        self.storages = {key: (ref, n) for key, (ref, n) in self.storages.items() if not ref.expired()}
        self.peak = max(self.peak, sum(n for _, n in self.storages.values()))
        return out


def make_step(path: str, hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
    yes, no = YES % weight.shape[0], NO % weight.shape[0]
    upstream = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(1))  # d loss / d logit

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if path == "full":
                logit = full_answer(F.linear(hidden, weight), yes, no)
            else:
                logit = answer_row_logit(hidden, weight, None, yes, no)
        logit.backward(upstream)  # the head alone: no loss (CPU log_sigmoid alone costs ~6 ms on 32 values)
        hidden.grad = weight.grad = None

    return step


def measure(shape: tuple[int, int], dtype_name: str, trainable: bool, rows: int, repeats: int) -> dict[str, dict]:
    """{path: {ms, peak_mb}}: both paths on the same weight and hidden states, their timed steps interleaved so
    that the machine's load changes reach both."""
    hidden_size, vocab = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).to(dtype).requires_grad_(trainable)
    hidden = torch.randn(rows, hidden_size, generator=gen).to(dtype).requires_grad_(True)
    steps = {path: make_step(path, hidden, weight, dtype) for path in PATHS}
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    start = time.perf_counter()
    for step in [*steps.values()] * 2:  # warm-up
        step()
    warm = (time.perf_counter() - start) / 4
    # sub-millisecond steps: more repeats, about a second's worth (a median of 5 such is mostly the load's)
    for repeat in range(max(repeats, min(200, int(1.0 / max(warm, 1e-6))))):
        for path in PATHS if repeat % 2 == 0 else PATHS[::-1]:
            start = time.perf_counter()
            steps[path]()
            times[path].append(time.perf_counter() - start)
    result = {}
    for path, step in steps.items():
        with LiveBytes([weight, hidden]) as live:
            step()
        result[path] = {"ms": 1000 * statistics.median(times[path]), "peak_mb": live.peak / 2**20}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="scored rows (prompts) per step")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case (the median)")
    # 1: on a shared 2-core machine a second thread's wake-up (4-80 ms) dominated sub-millisecond ops
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--shapes", default="tiny,1.5b", help="model shapes, comma-separated: tiny, 1.5b")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    known = shapes()
    warm_until = time.perf_counter() + 3.0
    while time.perf_counter() < warm_until:  # a fresh process's first seconds run small ops ~100x slower: not kept
        measure(known["tiny"], "fp32", False, args.rows, 1)
    print(f"rows={args.rows} repeats={args.repeats} threads={torch.get_num_threads()} (median ms/step, peak MiB)")
    headers = ["shape", "dtype", "LM head", "full ms", "two-row ms", "time ratio", "full peak MiB", "two-row peak MiB"]
    print("| " + " | ".join([*headers, "memory ratio"]) + " |\n" + "|---" * (len(headers) + 1) + "|")
    for name in args.shapes.split(","):
        hidden, vocab = known[name]
        for dtype_name in DTYPES:
            for trainable in (False, True):
                got = measure(known[name], dtype_name, trainable, args.rows, args.repeats)
                full, two = got["full"], got["two_rows"]
                print(
                    f"| {name} ({hidden} x {vocab}) | {dtype_name} | {'trainable' if trainable else 'frozen'} "
                    f"| {full['ms']:.3g} | {two['ms']:.3g} | {full['ms'] / two['ms']:.1f}x "
                    f"| {full['peak_mb']:.3g} | {two['peak_mb']:.3g} | {full['peak_mb'] / two['peak_mb']:.1f}x |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
