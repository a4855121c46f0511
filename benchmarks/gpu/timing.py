"""The timed window of a training run, measured the same way for every system: warm-up steps first, then one
clock around `timed` steps (a device synchronize at the window's two edges only: nothing inside the window waits
for the device because of the measurement), and the window's batches as the host built them (real tokens, token
slots computed, distinct shapes) for tokens/s, MFU and hardware utilisation."""

from __future__ import annotations

import time

import torch

from benchmarks.gpu.flops import Shape, step_flops
from lychee_exp.data.packing import length_chunks


class WindowClock:
    """Call `step_done(step)` after each optimizer step (1-based); the window is steps warmup+1 .. warmup+timed."""

    def __init__(self, warmup: int, timed: int, device: torch.device):
        self.warmup, self.timed, self.device = warmup, timed, device
        self.start = self.end = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step_done(self, step: int) -> None:
        if step == self.warmup:
            self.start = self._now()
        elif step == self.warmup + self.timed:
            self.end = self._now()

    @property
    def seconds(self) -> float:
        if self.start is None or self.end is None:
            raise RuntimeError(f"the run ended before its timed window (warm-up {self.warmup}, timed {self.timed})")
        return self.end - self.start


def forward_rows(batch: dict, forward_chunks: int) -> tuple[list[int], list[int], tuple]:
    """(real lengths, computed width per row, shape) of one host batch: a padded batch (attention_mask: each row
    computed at its forward chunk's width), or a packed one (lengths: each prompt at its own length, plus the
    rounding pad as one more row that carries no model FLOPs)."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(-1).tolist()
        widths = [0] * len(lengths)
        for rows, width in length_chunks(lengths, forward_chunks):
            for r in rows:
                widths[r] = width
        return lengths, widths, tuple(ids.shape)
    lengths = batch["lengths"].tolist()
    pad = ids.numel() - sum(lengths)
    return [*lengths, 0], [*lengths, pad], tuple(ids.shape)


class BatchLog:
    """Every batch a run drew, in order (batch k feeds step k + 1 without accumulation, whatever is prefetched)."""

    def __init__(self, forward_chunks: int = 1):
        self.forward_chunks = forward_chunks
        self.batches: list[tuple[list[int], list[int], tuple]] = []

    def add(self, batch: dict) -> None:
        self.batches.append(forward_rows(batch, self.forward_chunks))


def window_figures(
    log: BatchLog, clock: WindowClock, shape: Shape, lora: int, checkpointing: bool, peak_tflops: float | None
) -> dict:
    """The timed window's figures: tokens/s of real tokens, MFU (model FLOPs), hardware utilisation (slots
    computed, recomputation counted), padding share, distinct shapes (and how many first appeared in the window)."""
    warm, timed = log.batches[: clock.warmup], log.batches[clock.warmup : clock.warmup + clock.timed]
    seconds = clock.seconds
    real = sum(sum(lengths) for lengths, _, _ in timed)
    slots = sum(sum(widths) for _, widths, _ in timed)
    model, hardware = step_flops(shape, lora, [(lengths, widths) for lengths, widths, _ in timed], checkpointing)
    seen = {s for *_, s in warm}
    shapes = {s for *_, s in timed}
    per_s = 1e12 * (peak_tflops or float("nan"))
    return {
        "tokens_per_s": round(real / seconds, 1),
        "rows_per_s": round(sum(len([n for n in lengths if n]) for lengths, _, _ in timed) / seconds, 2),
        "model_tflops": round(model / seconds / 1e12, 2),
        "mfu": round(model / seconds / per_s, 4) if peak_tflops else None,
        "hardware_utilisation": round(hardware / seconds / per_s, 4) if peak_tflops else None,
        "timed_steps": len(timed),
        "warmup_steps": len(warm),
        "timed_seconds": round(seconds, 3),
        "distinct_shapes": len(shapes | seen),
        "shapes_first_seen_in_window": len(shapes - seen),
        "padding_share": round(1 - real / slots, 4) if slots else 0.0,
        "real_tokens_per_step": round(real / max(1, len(timed)), 1),
        "token_slots_per_step": round(slots / max(1, len(timed)), 1),
        "widths_seen": sorted({s[-1] for *_, s in log.batches}),  # every batch's width (a packed row's included)
    }


def peak_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_memory_mb": None, "peak_reserved_mb": None}
    return {
        "peak_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
        "peak_reserved_mb": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
    }
