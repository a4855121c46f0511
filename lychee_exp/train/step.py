"""Forward and backward over one accumulation window: micro-batches (padded, in forward chunks, or packed) under
autocast, with DDP's gradient all-reduce on the window's last backward only. Nothing here reads a device value:
the window's statistics stay on the device until the trainer reads them (docs/performance.md)."""

from __future__ import annotations

import contextlib
import time

import torch

from lychee_exp.data.packing import HOST_KEYS, length_chunks, padded_slots
from lychee_exp.model.precision import autocast
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.parallel.sharding import gradient_sync

STATS = ("loss_sum", "tokens", "queries", "distill_sum", "padded")  # the order of accumulate()'s statistics
_PACKED_KEYS = ("position_ids", "cu_seqlens", "last_index")


class WindowStep:
    def __init__(self, train_model, loss_fn, scaler, precision: str, env: DistEnv, forward_chunks: int):
        self.train_model, self.loss_fn, self.scaler, self.precision = train_model, loss_fn, scaler, precision
        self.env, self.device, self.forward_chunks = env, env.device, forward_chunks
        self.shapes: set[tuple[int, int]] = set()  # distinct (rows, width) forwarded: each may plan its own kernels

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device.type, self.precision)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        # pinned by the DataLoader on CUDA, so the copy does not wait for the device
        return tensor.to(self.device, non_blocking=True)

    def _model_inputs(self, inputs: dict) -> tuple[dict, int, int]:
        """The model's keyword inputs for one micro-batch, its real tokens and its token slots computed (both
        counted on the host copy)."""
        if "cu_seqlens" in inputs:  # packed: one row, every slot computed (the rounding pad included)
            packed = {key: self._to_device(inputs[key]) for key in _PACKED_KEYS}
            packed.update({key: inputs[key] for key in HOST_KEYS})
            self.shapes.add(tuple(inputs["input_ids"].shape))
            return {"packed": packed}, int(inputs["lengths"].sum()), inputs["input_ids"].numel()
        mask = inputs["attention_mask"]
        chunks = length_chunks(mask.sum(-1).tolist(), self.forward_chunks)
        self.shapes.update((len(rows), width) for rows, width in chunks)
        return {"attention_mask": self._to_device(mask), "chunks": chunks}, int(mask.sum()), padded_slots(chunks)

    def accumulate(self, batches, micro_steps: int, divisor: float) -> tuple[torch.Tensor, float, float]:
        """Forward and backward over `micro_steps` batches whose summed losses are divided by `divisor` (the
        schedule's: the step's queries over all ranks / world size, since DDP averages over ranks; a dummy batch,
        a token-budget rank's empty share, weighs 0 but still runs its backward, as DDP needs); returns the
        all-reduced statistics in STATS order (loss sum, tokens, queries, distillation term sum, token slots
        computed, padding included) as a float64 device tensor, not read here, and this rank's data-wait and
        busy seconds."""
        env = self.env
        wait = busy = 0.0
        # NCCL reduces CUDA tensors only; device-side sums are added on the device, host counts on the host
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        distill_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = queries = slots = 0
        for micro in range(micro_steps):
            fetched = time.perf_counter()
            inputs = next(batches)
            computed = time.perf_counter()
            wait += computed - fetched
            # DDP all-reduces (FSDP reduce-scatters) gradients on the window's last backward only
            sync = micro == micro_steps - 1 or not env.distributed
            kwargs, batch_tokens, batch_slots = self._model_inputs(inputs)
            teacher = inputs.get("teacher_scores")
            with gradient_sync(self.train_model, sync), self.autocast():
                logits = self.train_model(self._to_device(inputs["input_ids"]), **kwargs)
                per_query, distill = self.loss_fn(logits, None if teacher is None else self._to_device(teacher))
            busy += time.perf_counter() - computed
            dummy = inputs.get("dummy", False)
            self.scaler.scale(per_query.sum() * (0.0 if dummy else 1.0 / divisor)).backward()
            if dummy:
                slots += batch_slots  # computed, and nothing real in it
                continue
            loss_sum += per_query.detach().sum()
            if distill is not None:
                distill_sum += distill.detach().sum()
            tokens, queries, slots = tokens + batch_tokens, queries + per_query.shape[0], slots + batch_slots
        counts = torch.tensor([tokens, queries, slots], dtype=torch.float64)
        if self.device.type == "cuda":
            counts = counts.pin_memory()
        counts = counts.to(self.device, non_blocking=True)
        stats = torch.stack([loss_sum, counts[0], counts[1], distill_sum, counts[2]])
        return env.all_reduce_sum(stats), wait, busy + wait
