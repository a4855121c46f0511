"""A torch.profiler summary of a few training steps, taken after a run's timed window (so that the profiler's
own cost stays out of the timed figures): the top kernels by device time and the share of the profiled wall time
spent in attention, GEMM, elementwise work, the optimizer, other kernels, and idle (no kernel running). On the CPU
(the --tiny dry run) the "kernels" are the aten operators' own CPU time."""

from __future__ import annotations

import time

import torch

# by a substring of the kernel's (lower-cased) name, first match wins: attention before GEMM (flash kernels are
# matrix work too), the optimizer before elementwise (its kernels are elementwise multi-tensor kernels)
CATEGORIES = (
    ("attention", ("flash", "fmha", "attn", "attention", "varlen", "sdpa")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused_")),
    (
        "gemm",
        (
            "gemm",
            "cutlass",
            "xmma",
            "nvjet",
            "cublas",
            "wgmma",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::matmul",
            "aten::linear",
        ),
    ),  # fmt: skip
    ("elementwise", ("elementwise", "vectorized", "reduce", "copy", "cat", "fill", "index", "triton", "aten::")),
)
TOP = 15


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


class StepProfiler:
    """Call `step_done(step)` after each optimizer step: profiles steps first+1 .. first+steps."""

    def __init__(self, first: int, steps: int, device: torch.device):
        self.first, self.steps, self.device = first, steps, device
        self.profiler = None
        self.wall_s = 0.0
        self._started = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_done(self, step: int) -> None:
        if not self.steps:
            return
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._sync()
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            self._started = time.perf_counter()
        elif step == self.first + self.steps and self.profiler is not None:
            self._sync()
            self.wall_s = time.perf_counter() - self._started
            self.profiler.__exit__(None, None, None)

    def summary(self) -> dict:
        if self.profiler is None or not self.wall_s:
            return {"skipped": "the run ended before its profiled steps"}
        cuda = self.device.type == "cuda"
        kernels = []
        for event in self.profiler.key_averages():
            if cuda:
                is_kernel = str(getattr(event, "device_type", "")).endswith("CUDA")
                us = getattr(event, "self_device_time_total", 0) if is_kernel else 0
            else:  # leaf operators' own time; wrappers (profiler labels, autograd nodes) left out
                us = event.self_cpu_time_total if event.key.startswith("aten::") else 0
            if us > 0:
                kernels.append((event.key, us / 1e6, event.count))
        return summarise(kernels, self.wall_s, self.steps, "device" if cuda else "cpu (aten self time)")


def summarise(kernels: list[tuple[str, float, int]], wall_s: float, steps: int, clock: str) -> dict:
    """kernels: (name, seconds, calls). Shares are of the profiled wall time; idle = the wall time no kernel
    covered (kernels of one stream do not overlap: their sum is the busy time)."""
    busy = sum(s for _, s, _ in kernels)
    shares = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
    for name, seconds, _ in kernels:
        shares[category(name)] += seconds
    top = sorted(kernels, key=lambda k: -k[1])[:TOP]
    return {
        "steps": steps,
        "clock": clock,
        "wall_s": round(wall_s, 4),
        "kernel_s": round(busy, 4),
        "share": {k: round(v / wall_s, 4) for k, v in shares.items()} | {"idle": round(max(0.0, 1 - busy / wall_s), 4)},
        "top_kernels": [
            {"name": name[:160], "seconds": round(s, 5), "calls": calls, "category": category(name)}
            for name, s, calls in top
        ],
    }
