"""The batches every system of the peer benchmark trains on: exactly those lychee_exp's own loader yields; and
the long-tailed data file of its `--mix longtail`.

A run's config is composed from the benchmark's overrides; the first epoch's groups come from lychee_exp's
sampler and collator (one process, no bucketing), and the model from `load_reranker`, so that every peer starts
from the same weights, prompts, truncation and batches as lychee_exp parallel=single.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.peer_loops import Step


def build_steps(overrides: list[str], out: Path, count: int):
    """(run config, prompt encoder, reranker, `count` steps of token ids + labels + text pairs)."""
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.data.groups import GroupCollator, TrainGroups
    from lychee_exp.data.sampling import ResumableSampler
    from lychee_exp.job.in_process import compose_job
    from lychee_exp.model.reranker import load_reranker
    from lychee_exp.train.inputs import load_inputs

    cfg = to_run_config(compose_job(overrides, out))
    inputs = load_inputs(cfg)  # what a lychee_exp run reads: the same queries, tokenizer and prompt encoder
    tokenizer, encoder = inputs.tokenizer, inputs.encoder
    instruction = cfg.data.instruction or cfg.model.prompt.default_instruction
    groups = TrainGroups(
        inputs.train_queries, cfg.data.train_group_size, instruction, cfg.seed, cfg.data.random_negatives
    )
    sampler = ResumableSampler(groups, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    sampler.set_epoch(0)
    order, batch = list(sampler), cfg.data.batch_size
    if len(order) < count * batch:
        raise ValueError(f"{len(order)} training queries make fewer than {count} steps of {batch}")
    collate = GroupCollator(encoder)
    steps = []
    for k in range(count):
        chosen = [groups[i] for i in order[k * batch : (k + 1) * batch]]
        inputs = collate(chosen)
        labels = torch.tensor([1.0 if j == 0 else 0.0 for _ in chosen for j in range(cfg.data.train_group_size)])
        pairs = [
            (_text(tokenizer, encoder.encode(instr, query, "")), _document(tokenizer, doc, cfg))
            for instr, query, docs, _ in chosen
            for doc in docs
        ]
        steps.append(Step(inputs["input_ids"], inputs["attention_mask"], labels, pairs))
    model = load_reranker(cfg.model, encoder, cfg.seed, training=True)  # the peers train it
    return cfg, encoder, model, steps


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def _document(tokenizer, doc: str, cfg) -> str:
    """The document as lychee_exp truncates it (model.prompt.doc_max_len tokens), back as text."""
    ids = tokenizer(" " + doc, add_special_tokens=False)["input_ids"][: cfg.model.prompt.doc_max_len]
    return _text(tokenizer, ids)


def longtail_file(out: Path, queries: int, seed: int = 0) -> Path:
    """Sample-set queries whose candidates are long-tailed in length (32-2048 tokens, median ~100): a query's
    documents share a length scale (candidates of one query tend to come from the same kind of source)."""
    import random

    from lychee_exp.data.queries import load_queries

    path = out / "longtail.jsonl"
    base = load_queries("pkg://lychee_exp.assets/sample/train.jsonl", "data.train_file", queries)
    words = " ".join(d for q in base for d in q.pos + q.neg).split()
    rng = random.Random(seed)
    with path.open("w") as handle:
        for q in base:
            scale = min(2048, max(32, int(rng.lognormvariate(4.6, 1.0))))
            # ~0.6 words per token of the tiny BPE; each document 50-100% of the query's scale
            docs = [" ".join(rng.choices(words, k=max(16, int(scale * rng.uniform(0.5, 1.0) * 0.6)))) for _ in range(4)]
            handle.write(json.dumps({"query": q.query, "pos": docs[:1], "neg": docs[1:]}) + "\n")
    return path


if __name__ == "__main__":
    from lychee_exp.cli import library_module

    library_module(__spec__.name, __doc__, "benchmarks.peers", "benchmarks.padded_vs_packed")
