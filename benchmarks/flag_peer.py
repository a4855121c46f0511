"""FlagEmbedding's own reranker trainer (flagembedding 1.4.2, `FlagEmbedding.finetune.reranker.encoder_only.base`),
the peer that both side-by-side benchmarks run as `flag_embedding` (`pip install -e .[bench]` installs it):

    python -m benchmarks.peers          (identical_batches)
    python -m benchmarks.own_batching   (own_file)

- identical_batches: its CrossEncoderModel around the backbone of the model every peer trains (same weights, same
  new head) and its EncoderOnlyRerankerTrainer, fed the peer benchmark's batches in order, one step's query
  groups per batch, with the token_type_ids its tokenizer writes for a (query, document) pair.
- own_file: its EncoderOnlyRerankerRunner reads the JSONL file, samples each query's group (train_group_size)
  and tokenizes the (query, document) pairs as its docs show; only the model is the other peers' (seeded head,
  lychee's dropout), which its runner has no argument for.

Its loss is its own: cross-entropy over each query's group (the positive first) instead of the other peers'
pointwise BCE; the forward and backward are the same work (one logit per pair). bf16 is its TrainingArguments'
`bf16=True`, as for the other Trainer-based peers.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.peer_loops import Settings, Step, common_args, in_order, pair_rows, step_end_callback


def identical_batches(model, steps: list[Step], s: Settings, encoder, group: int, out_dir: str) -> dict:
    """Trains lychee_exp's `model` (a sequence-classification Reranker) through FlagEmbedding's model and Trainer;
    counts the non-pad tokens of the batches it built (`tokens`, `padded`), as sentence-transformers' peer does."""
    from FlagEmbedding.abc.finetune.reranker import AbsRerankerTrainingArguments
    from FlagEmbedding.finetune.reranker.encoder_only.base import CrossEncoderModel, EncoderOnlyRerankerTrainer

    from lychee_exp.data.pair_prompt import token_types

    rows = [r["input_ids"] for r in pair_rows(steps)]
    groups = [rows[i : i + group] for i in range(0, len(rows), group)]  # a query's pairs are consecutive
    queries = len(steps[0].labels) // group
    counts = {"tokens": 0, "padded": 0}

    def collate(batch_groups):  # its collator's output: {"pair": the padded pairs of the step's groups}
        batch = encoder.pad([ids for g in batch_groups for ids in g])
        if model.sep_id is not None:  # BERT-style pairs: the segment ids its tokenizer would have written
            batch["token_type_ids"] = token_types(batch["input_ids"], batch["attention_mask"], model.sep_id)
        counts["tokens"] += int(batch["attention_mask"].sum())
        counts["padded"] += batch["attention_mask"].numel()
        return {"pair": batch}

    ends: list[float] = []
    # its per-device batch counts query groups, not pairs
    args = {**common_args(out_dir, steps, s), "per_device_train_batch_size": queries, "remove_unused_columns": False}
    trainer = in_order(EncoderOnlyRerankerTrainer)(
        model=CrossEncoderModel(model.backbone, tokenizer=encoder.tokenizer, train_batch_size=queries),
        args=AbsRerankerTrainingArguments(**args),
        train_dataset=groups,
        data_collator=collate,
        processing_class=encoder.tokenizer,
        callbacks=[step_end_callback(lambda: ends.append(time.perf_counter()))],
    )
    trainer.train()
    return {"ends": ends, **counts}


def own_file(spec: dict, out: str) -> None:
    """The own-batching benchmark's run: FlagEmbedding's runner on spec's JSONL file; its steps stamped on
    own_batching_loops.METER, whose wrapped forward counts what its model reads."""
    from FlagEmbedding.abc.finetune.reranker import (
        AbsRerankerDataArguments,
        AbsRerankerModelArguments,
        AbsRerankerTrainingArguments,
    )
    from FlagEmbedding.finetune.reranker.encoder_only.base import CrossEncoderModel, EncoderOnlyRerankerRunner
    from transformers import AutoTokenizer

    from benchmarks import own_batching_loops as loops

    class Runner(EncoderOnlyRerankerRunner):
        def load_tokenizer_and_model(self):  # the other peers' model (its runner would keep the 0.1 dropout)
            tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
            batch = self.training_args.per_device_train_batch_size
            return tokenizer, CrossEncoderModel(loops.sequence_classifier(spec), tokenizer, train_batch_size=batch)

    # the template's text before the query and before the document, as its instruction fields
    query_head, rest = spec["template"].split("{query}")
    doc_head = rest.split("{document}")[0].strip() + " "
    data = AbsRerankerDataArguments(
        train_data=[spec["train_file"]],
        cache_path=str(Path(out) / "cache"),
        train_group_size=loops.DOCS_PER_QUERY,
        query_max_len=spec["query_max_len"],
        passage_max_len=spec["doc_max_len"],
        query_instruction_for_rerank=query_head,
        passage_instruction_for_rerank=doc_head,
    )
    args = {**loops.trainer_args(spec, str(Path(out) / "flag")), "dataloader_num_workers": 0}
    args["per_device_train_batch_size"] = spec["pairs_per_step"] // loops.DOCS_PER_QUERY  # query groups a step
    runner = Runner(
        model_args=AbsRerankerModelArguments(model_name_or_path=spec["model_path"]),
        data_args=data,
        training_args=AbsRerankerTrainingArguments(**args),
    )
    runner.trainer.add_callback(step_end_callback(loops.METER.stamp))
    runner.trainer.train()  # not runner.run(): that also saves the model, which no other system does here


if __name__ == "__main__":
    from lychee_exp.cli import library_module

    library_module(__spec__.name, __doc__, "benchmarks.peers", "benchmarks.own_batching")
