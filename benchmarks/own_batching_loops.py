"""The own-batching benchmark's systems: each reads the same JSONL file and batches it as its own docs show.

- hf_trainer: a `datasets.Dataset` of (text, label) rows, tokenized by `map`, `DataCollatorWithPadding`
  (dynamic padding), `transformers.Trainer` with a BCE-with-logits `compute_loss_func`.
- torch_loop: a shuffled `DataLoader` over the pairs whose collate_fn calls the tokenizer with padding=True.
- st_cross_encoder: `CrossEncoderTrainer` on its documented (query, document, label) columns with
  `BinaryCrossEntropyLoss`; it tokenizes the two texts as a pair, so it reads one [SEP] more per pair.
- flag_embedding: FlagEmbedding's EncoderOnlyRerankerRunner reads the file itself (benchmarks.flag_peer).
- lychee: `python -m lychee_exp.run parallel=single gpus=1` in a process of its own, with its defaults
  (benchmarks.own_batching reads its metrics.json; the Meter below times the peers).

Precision (spec["precision"]): bf16 is the Trainer-based peers' `bf16=True`, the bare loop's autocast to
bfloat16 and lychee's `trainer.precision=bf16`; fp32 is none of them.

Every peer is measured the same way: `Meter` wraps the model class's forward before any model exists and
records each call's attention mask (non-pad tokens = its sum, slots = its size, pairs = its rows), and every
peer stamps the wall clock at each step end (a Trainer callback, the loop itself).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.peer_loops import Settings, autocast, step_end_callback, trainer_arguments

DOCS_PER_QUERY = 4  # 1 positive + 3 negatives from the file: lychee's groups of 4


@dataclass(frozen=True)
class Pair:
    query: str  # cut to query_max_len tokens
    document: str  # cut to doc_max_len tokens
    label: float


@dataclass
class Meter:
    """What the model read (per forward call) and when each step ended (with how many calls came before)."""

    calls: list[tuple[torch.Tensor, int, int | torch.Tensor]] = field(default_factory=list)  # (mask sum, slots, rows)
    stamps: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, calls so far)

    def install(self, model_path: str):
        """Wraps the forward of the class AutoModelForSequenceClassification picks for this checkpoint."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

        cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(AutoConfig.from_pretrained(model_path))]
        undo, undo_packed = self.wrap(cls), self.wrap_packed(_encoder_class(cls))
        return lambda: (undo(), undo_packed())

    def wrap_packed(self, encoder_cls):
        """Records the encoder's packed calls (lychee_exp's packed rows skip the classifier class's forward,
        model.packed): non-pad tokens, the row's slots, and its prompts (segments not starting with pad)."""
        from lychee_exp.data.packing import BOUNDS

        original = encoder_cls.forward

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            bounds = kwargs.get(BOUNDS)
            if bounds is not None:
                ids, pad = kwargs["input_ids"], module.config.pad_token_id
                prompts = (ids[0, list(bounds[:-1])] != pad).sum()  # a device count: no host sync here
                self.calls.append(((ids != pad).sum(), ids.numel(), prompts))
            return original(module, *args, **kwargs)

        encoder_cls.forward = forward
        return lambda: setattr(encoder_cls, "forward", original)

    def wrap(self, cls):
        """Records every call of cls.forward from now on (every instance, existing or not); returns the undo."""
        original = cls.forward

        @functools.wraps(original)  # keeps the signature Trainer reads to drop unused dataset columns
        def forward(module, *args, **kwargs):
            mask = kwargs.get("attention_mask")
            if mask is None:  # positional (input_ids, attention_mask, ...)
                mask = args[1] if len(args) > 1 else torch.ones_like(kwargs.get("input_ids", args[0]))
            self.calls.append((mask.detach().sum(), mask.numel(), mask.shape[0]))  # no host sync here
            return original(module, *args, **kwargs)

        cls.forward = forward
        return lambda: setattr(cls, "forward", original)

    def stamp(self) -> None:
        self.stamps.append((time.perf_counter(), len(self.calls)))

    def window(self, warmup: int) -> dict:
        """Figures over the steps after `warmup` (>= 1): wall clock from the end of step `warmup` to the last
        step end, and what the model read in between."""
        if warmup < 1 or len(self.stamps) <= warmup:
            raise RuntimeError(
                f"{len(self.stamps)} step ends stamped; a window after {warmup} warm-up steps needs more"
            )
        marks = [calls for _, calls in self.stamps[warmup - 1 :]]
        calls = self.calls[marks[0] : marks[-1]]
        return {
            "seconds": self.stamps[-1][0] - self.stamps[warmup - 1][0],
            "steps": len(marks) - 1,
            "pairs": sum(int(c[2]) for c in calls),
            "tokens": float(sum(int(c[0]) for c in calls)),
            "slots": sum(c[1] for c in calls),
            "pairs_per_step": [sum(int(c[2]) for c in self.calls[a:b]) for a, b in zip(marks, marks[1:])],
        }


METER = Meter()


def _encoder_class(cls):
    """The base model class a *ForSequenceClassification class wraps (e.g. BertModel), by transformers' naming."""
    import importlib

    module = importlib.import_module(cls.__module__)
    return getattr(module, cls.__name__.replace("ForSequenceClassification", "Model"))


def cut(tokenizer, text: str, max_tokens: int) -> str:
    """`text` up to the end of its first `max_tokens` tokens (as lychee's prompt encoder cuts a field)."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text if len(offsets) <= max_tokens else text[: offsets[max_tokens - 1][1]]


def read_pairs(path: Path, tokenizer, query_max_len: int, doc_max_len: int) -> list[Pair]:
    """(query, document, label) pairs from a FlagEmbedding-style JSONL file: each query's first positive and
    first DOCS_PER_QUERY - 1 negatives, fields cut to their token caps."""
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            query = cut(tokenizer, row["query"], query_max_len)
            docs = [(d, 1.0) for d in row["pos"][:1]] + [(d, 0.0) for d in row["neg"][: DOCS_PER_QUERY - 1]]
            pairs += [Pair(query, cut(tokenizer, d, doc_max_len), label) for d, label in docs]
    return pairs


def prompt_text(template: str, pair: Pair) -> str:
    return template.format(query=pair.query, document=pair.document)


def st_columns(template: str, pair: Pair) -> tuple[str, str]:
    """The prompt split where the document starts: sentence-transformers' (query, document) columns."""
    head, tail = template.split("{document}")
    return head.format(query=pair.query).rstrip(), "{document}".join(["", tail]).format(document=pair.document)


def hf_tokenize(tokenizer, texts: list[str]) -> dict:
    return tokenizer(texts, truncation=True)


def loop_collate(tokenizer, template: str, rows: list[Pair]) -> dict:
    batch = tokenizer([prompt_text(template, r) for r in rows], padding=True, truncation=True, return_tensors="pt")
    batch["labels"] = torch.tensor([r.label for r in rows])
    return batch


def sequence_classifier(spec: dict):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(spec["seed"])
    return AutoModelForSequenceClassification.from_pretrained(spec["model_path"], num_labels=1, **spec["dropout"])


def _bce(outputs, labels, num_items_in_batch=None):
    return F.binary_cross_entropy_with_logits(outputs["logits"].view(-1), labels.float())


def settings(spec: dict) -> Settings:
    device, bf16 = torch.device(spec["device"]), spec["precision"] == "bf16"
    return Settings(spec["lr"], spec["weight_decay"], spec["max_grad_norm"], spec["seed"], device, bf16)


def trainer_args(spec: dict, out: str) -> dict:
    """A Trainer-based peer's arguments, bf16 included."""
    s = settings(spec)
    return trainer_arguments(out, s, spec["pairs_per_step"], spec["max_steps"], spec["warmup_ratio"])


def hf_trainer(spec: dict, pairs: list[Pair], out: str) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rows = Dataset.from_dict(
        {"text": [prompt_text(spec["template"], p) for p in pairs], "label": [p.label for p in pairs]}
    )
    rows = rows.map(lambda b: hf_tokenize(tokenizer, b["text"]), batched=True, remove_columns=["text"])
    trainer = Trainer(
        model=sequence_classifier(spec),
        args=TrainingArguments(**trainer_args(spec, out)),
        train_dataset=rows,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_loss_func=_bce,
        callbacks=[step_end_callback(METER.stamp)],
    )
    trainer.train()


def torch_loop(spec: dict, pairs: list[Pair], out: str) -> None:
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer, get_linear_schedule_with_warmup

    s = settings(spec)
    device = s.device
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    model = sequence_classifier(spec).to(device).train()
    loader = DataLoader(
        pairs,
        batch_size=spec["pairs_per_step"],
        shuffle=True,
        generator=torch.Generator().manual_seed(spec["seed"]),
        collate_fn=lambda rows: loop_collate(tokenizer, spec["template"], rows),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    total = spec["max_steps"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(spec["warmup_ratio"] * total), total)
    step = 0
    while step < total:
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            with autocast(s):  # the BCE itself runs in fp32 under autocast
                loss = F.binary_cross_entropy_with_logits(model(**batch).logits.view(-1), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # what a loop that logs its loss pays: the step is done
            METER.stamp()
            step += 1
            if step == total:
                break


def st_cross_encoder(spec: dict, pairs: list[Pair], out: str) -> None:
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    torch.manual_seed(spec["seed"])
    model = CrossEncoder(spec["model_path"], num_labels=1, device=spec["device"], config_kwargs=spec["dropout"])
    columns = [st_columns(spec["template"], p) for p in pairs]
    rows = Dataset.from_dict(
        {"query": [a for a, _ in columns], "document": [b for _, b in columns], "label": [p.label for p in pairs]}
    )
    trainer = CrossEncoderTrainer(
        model=model,
        args=CrossEncoderTrainingArguments(**trainer_args(spec, out)),
        train_dataset=rows,
        loss=BinaryCrossEntropyLoss(model),
        callbacks=[step_end_callback(METER.stamp)],
    )
    trainer.train()


if __name__ == "__main__":
    from lychee_exp.cli import library_module

    library_module(__spec__.name, __doc__, "benchmarks.own_batching")
