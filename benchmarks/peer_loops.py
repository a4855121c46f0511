"""The training loops a user would pick instead of lychee_exp, each on the same pre-built batches.

Every peer trains the model lychee_exp builds (`load_reranker`: same weights, same new head, dropout as configured)
with AdamW (its fused kernel, the default of transformers' Trainer and of lychee_exp), a linear schedule without
warm-up, gradient clipping at 1.0 and the pointwise loss (binary cross-entropy on the relevance logit, the mean over
the step's pairs), one step per batch, in batch order.
Each returns the `perf_counter` time at the end of every step, so that warm-up can be cut off the same way.
sentence-transformers tokenizes its own text pairs, so it counts its own tokens (`tokens`).
Precision: `Settings.bf16` is each peer's own bf16 switch (the Trainer-based peers' `bf16=True` in their
TrainingArguments, the bare loop's `torch.autocast` to bfloat16); off, all run in fp32.
FlagEmbedding's trainer, the fourth peer, lives in benchmarks.flag_peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Step:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor  # float, 1 for a positive pair
    pairs: list[tuple[str, str]]  # (prompt up to the document, document) texts, for sentence-transformers


@dataclass
class Settings:
    lr: float
    weight_decay: float
    max_grad_norm: float
    seed: int
    device: torch.device
    bf16: bool = False  # mixed precision: weights and optimizer stay fp32, the forward computes in bfloat16


def autocast(s: Settings):
    """A bare loop's bf16 switch: the forward and loss under autocast to bfloat16 (a no-op without bf16)."""
    return torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=s.bf16)


class PairLoss(nn.Module):
    """A reranker plus the pointwise loss, in the shape transformers.Trainer expects of a model."""

    def __init__(self, reranker: nn.Module):
        super().__init__()
        self.reranker = reranker

    def forward(self, input_ids, attention_mask, labels=None):
        logits = self.reranker(input_ids, attention_mask)
        loss = F.binary_cross_entropy_with_logits(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def torch_loop(model: nn.Module, steps: list[Step], s: Settings) -> dict:
    model.to(s.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: max(0.0, 1 - i / len(steps)))
    ends = []
    for step in steps:
        with autocast(s):
            logits = model(step.input_ids.to(s.device), step.attention_mask.to(s.device))
            loss = F.binary_cross_entropy_with_logits(logits, step.labels.to(s.device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # what a loop that logs its loss pays: the step is done
        ends.append(time.perf_counter())
    return {"ends": ends}


def step_end_callback(on_step_end: Callable[[], None]):
    """A transformers TrainerCallback that calls `on_step_end()` after every optimizer step (built here, lazily:
    transformers is imported only by the peers that use it)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            on_step_end()

    return StepClock()


def pair_rows(steps: list[Step]) -> list[dict]:
    return [
        {"input_ids": ids[mask.bool()].tolist(), "labels": float(label)}
        for step in steps
        for ids, mask, label in zip(step.input_ids, step.attention_mask, step.labels)
    ]


def trainer_arguments(out_dir: str, s: Settings, pairs_per_step: int, max_steps: int, warmup_steps: float) -> dict:
    """What every Trainer-based peer is given: the step's pairs, the optimizer settings, a linear schedule, and
    no logging, saving or progress bar. `warmup_steps` below 1 is a ratio of the steps (transformers' reading)."""
    return {
        "output_dir": out_dir,
        "per_device_train_batch_size": pairs_per_step,
        "max_steps": max_steps,
        "learning_rate": s.lr,
        "weight_decay": s.weight_decay,
        "max_grad_norm": s.max_grad_norm,
        "lr_scheduler_type": "linear",
        "warmup_steps": warmup_steps,
        "logging_steps": 10**6,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": s.seed,
        "use_cpu": s.device.type == "cpu",
        "bf16": s.bf16,
    }


def common_args(out_dir: str, steps: list[Step], s: Settings) -> dict:
    """The identical-batches benchmark's: no warm-up, the fused AdamW lychee_exp uses, batches built in-process."""
    fixed = {"optim": "adamw_torch_fused", "dataloader_num_workers": 0}
    return {**trainer_arguments(out_dir, s, len(steps[0].labels), len(steps), 0), **fixed}


def in_order(trainer_cls: type) -> type:
    """A transformers.Trainer subclass that takes its rows in dataset order: the same batches as every other
    system, not a fresh shuffle."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer_cls):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return InOrder


def hf_trainer(model: nn.Module, steps: list[Step], s: Settings, encoder, out_dir: str) -> dict:
    """transformers.Trainer on (token ids, label) rows, batched in order and padded as lychee_exp pads."""
    from transformers import Trainer, TrainingArguments

    def collate(rows):
        batch = encoder.pad([r["input_ids"] for r in rows])
        batch["labels"] = torch.tensor([r["labels"] for r in rows])
        return batch

    ends: list[float] = []
    args = TrainingArguments(**common_args(out_dir, steps, s), remove_unused_columns=False)
    trainer = in_order(Trainer)(
        model=PairLoss(model),
        args=args,
        train_dataset=pair_rows(steps),
        data_collator=collate,
        callbacks=[step_end_callback(lambda: ends.append(time.perf_counter()))],
    )
    trainer.train()
    return {"ends": ends}


def st_cross_encoder(path: str, dropout: float | None, steps: list[Step], s: Settings, out_dir: str) -> dict:
    """sentence-transformers' CrossEncoderTrainer with BinaryCrossEntropyLoss on (prompt, document) text pairs."""
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from torch.utils.data import BatchSampler, SequentialSampler
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).to_dict()
    no_dropout = {k: dropout for k, v in config.items() if "dropout" in k and isinstance(v, float)}
    torch.manual_seed(s.seed)
    model = CrossEncoder(
        path, num_labels=1, device=str(s.device), config_kwargs=no_dropout if dropout is not None else None
    )
    batch_size = len(steps[0].labels)
    pairs = [p for step in steps for p in step.pairs]
    tokens = sum(int(model.preprocess(step.pairs)["attention_mask"].sum()) for step in steps)
    padded = sum(model.preprocess(step.pairs)["attention_mask"].numel() for step in steps)
    rows = Dataset.from_dict(
        {
            "text1": [a for a, _ in pairs],
            "text2": [b for _, b in pairs],
            "label": [float(x) for step in steps for x in step.labels],
        }
    )

    class InOrderTrainer(CrossEncoderTrainer):
        def get_batch_sampler(self, dataset, batch_size, drop_last, *args, **kwargs):
            return BatchSampler(SequentialSampler(dataset), batch_size, drop_last)

    ends: list[float] = []
    args = CrossEncoderTrainingArguments(**common_args(out_dir, steps, s))
    trainer = InOrderTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        loss=BinaryCrossEntropyLoss(model),
        callbacks=[step_end_callback(lambda: ends.append(time.perf_counter()))],
    )
    assert batch_size == args.per_device_train_batch_size
    trainer.train()
    return {"ends": ends, "tokens": tokens, "padded": padded}


def timed_row(result: dict, batches: list, warmup: int, device) -> dict:
    """A peer's figures over its steps after `warmup`: from its step-end times and the batches' (or its own) token
    counts."""
    from lychee_exp.tracking.throughput import peak_memory_mb

    ends, timed = result["ends"], batches[warmup:]
    elapsed = ends[-1] - ends[warmup - 1]
    real = sum(int(b.attention_mask.sum()) for b in timed)
    padded = sum(b.attention_mask.numel() for b in timed)
    if "tokens" in result:  # a peer that builds its own batches: its own counts, scaled to the timed steps
        share = len(timed) / len(batches)
        real, padded = result["tokens"] * share, result["padded"] * share
    return {
        "pairs_per_s": sum(len(b.labels) for b in timed) / elapsed,
        "tokens_per_s": real / elapsed,
        "padding_share": 1 - real / padded,
        "peak_memory_mb": peak_memory_mb(device),
    }


if __name__ == "__main__":
    from lychee_exp.cli import library_module

    library_module(__spec__.name, __doc__, "benchmarks.peers")
