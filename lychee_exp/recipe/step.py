"""Forward and backward over one accumulation window: micro-batches in forward chunks, under autocast, with
DDP's gradient all-reduce on the window's last backward only."""

from __future__ import annotations

import contextlib
import time

import torch

from lychee_exp.core.chunks import length_chunks, padded_slots
from lychee_exp.core.distributed import DistEnv

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class WindowStep:
    def __init__(self, train_model, loss_fn, scaler, precision: str, env: DistEnv, forward_chunks: int):
        self.train_model, self.loss_fn, self.scaler, self.precision = train_model, loss_fn, scaler, precision
        self.env, self.device, self.forward_chunks = env, env.device, forward_chunks

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_AMP_DTYPES[self.precision])

    def accumulate(self, batches, micro_steps: int, window_queries: int) -> tuple[torch.Tensor, float, float]:
        """Forward and backward over `micro_steps` batches whose losses are divided by `window_queries` (this
        rank's queries in the window); returns the all-reduced (loss sum, tokens, queries, distillation term sum,
        token slots computed, padding included) and this rank's data-wait and busy seconds."""
        env = self.env
        wait = busy = 0.0
        stats = torch.zeros(5, dtype=torch.float64, device=self.device)  # NCCL reduces CUDA tensors only
        for micro in range(micro_steps):
            fetched = time.perf_counter()
            inputs = next(batches)
            computed = time.perf_counter()
            wait += computed - fetched
            # DDP all-reduces gradients on the window's last backward only
            sync = micro == micro_steps - 1 or not env.distributed
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            # planned on the host copy of the mask: no device sync
            chunks = length_chunks(mask.sum(-1).tolist(), self.forward_chunks)
            with contextlib.nullcontext() if sync else self.train_model.no_sync(), self.autocast():
                logits = self.train_model(
                    ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True), chunks=chunks
                )
                per_query, distill = self.loss_fn(logits, inputs.get("teacher_scores"))
            busy += time.perf_counter() - computed
            self.scaler.scale(per_query.sum() / window_queries).backward()
            distill_sum = distill.detach().sum() if distill is not None else torch.zeros(())
            loss_sum, tokens, queries = per_query.detach().sum(), mask.sum(), torch.tensor(len(per_query))
            values = (loss_sum, tokens, queries, distill_sum, torch.tensor(padded_slots(chunks)))
            stats += torch.stack([value.to(stats) for value in values])
        return env.all_reduce_sum(stats), wait, busy + wait
