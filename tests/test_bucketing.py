"""Length-bucketed sampling: deterministic per (seed, epoch), rank-consistent, resumable, and less padding; and
length chunks, which score a batch in groups of similar length with one pass's logits and gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_QWEN2
from transformers import AutoTokenizer

from lychee_exp.config.schema import PromptConfig, to_run_config
from lychee_exp.data.groups import GroupCollator, TrainGroups
from lychee_exp.data.packing import length_chunks, padded_slots
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.data.queries import load_queries
from lychee_exp.data.sampling import PromptLengths, bucketed_order, train_sampler
from lychee_exp.model.reranker import load_reranker
from lychee_exp.train.inputs import load_inputs

SAMPLE = "pkg://lychee_exp.assets/sample/train.jsonl"


@pytest.fixture(scope="module")
def setup():
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(TINY_QWEN2)), PromptConfig(doc_max_len=256), "left")
    groups = TrainGroups(load_queries(SAMPLE, "data.train_file", 200), 4, "Find the docs", seed=3)
    return groups, encoder


def _global_batches(groups, encoder, bucket, world, batch, accum=1, epoch=0, start=0):
    """Each optimizer step's queries across all ranks, as sets (the order inside a step does not matter)."""
    shards = []
    for rank in range(world):
        sampler = train_sampler(groups, encoder, bucket, 4, batch * world * accum, world, rank, seed=3)
        sampler.set_epoch(epoch)
        sampler.start = start * batch
        shards.append(list(sampler))
    assert len({len(s) for s in shards}) == 1  # every rank has the same number of items, so of batches
    per_step = batch * accum
    return [set().union(*(s[i : i + per_step] for s in shards)) for i in range(0, len(shards[0]), per_step)]


def test_order_is_a_deterministic_permutation_per_seed_and_epoch():
    lengths = [(i * 37) % 101 for i in range(100)]
    order = bucketed_order(lengths, 8, 4, seed=1, epoch=0)
    assert sorted(order) == list(range(100))
    assert order == bucketed_order(lengths, 8, 4, seed=1, epoch=0)
    assert order != bucketed_order(lengths, 8, 4, seed=1, epoch=1)
    assert order != bucketed_order(lengths, 8, 4, seed=2, epoch=0)
    # windows hold similar lengths: a pool of 32 of the 0..100 lengths sorted into 4 windows spreads ~25 each,
    # a random window of 8 ~78
    spreads = [
        max(lengths[i] for i in order[k : k + 8]) - min(lengths[i] for i in order[k : k + 8]) for k in range(0, 96, 8)
    ]
    assert max(spreads) < 45 and sum(spreads) / len(spreads) < 30


@pytest.mark.parametrize("world, batch, accum", [(2, 2, 1), (2, 1, 2), (4, 1, 1)])
def test_ranks_see_the_single_process_steps(setup, world, batch, accum):
    groups, encoder = setup
    single = _global_batches(groups, encoder, True, 1, batch * world * accum)
    assert _global_batches(groups, encoder, True, world, batch, accum) == single
    assert _global_batches(groups, encoder, True, world, batch, accum, epoch=1) != single


def test_resume_skips_into_the_same_order(setup):
    groups, encoder = setup
    whole = _global_batches(groups, encoder, True, 2, 2)
    assert _global_batches(groups, encoder, True, 2, 2, start=5) == whole[5:]


def test_lengths_follow_the_epoch_negatives_and_leave_the_dataset_epoch_alone(setup):
    groups, encoder = setup
    lengths = PromptLengths(groups, encoder)
    groups.set_epoch(7)
    first = lengths(0)
    assert groups.epoch == 7 and lengths(0) == first and lengths(1) != first
    groups.set_epoch(0)
    collate = GroupCollator(encoder)
    for i in (0, 5, 9):  # up to a constant (the empty document's tokens), the longest prompt of the group
        widths = collate([groups[i]])["attention_mask"].sum(dim=1)
        assert abs(first[i] - int(widths.max())) <= 2


def test_bucketing_cuts_padding(setup):
    groups, encoder = setup
    collate = GroupCollator(encoder)

    def padding_share(bucket: bool) -> float:
        sampler = train_sampler(groups, encoder, bucket, 64, 8, 1, 0, seed=3)
        order = list(sampler)
        real = padded = 0
        for k in range(0, len(order) - 7, 8):
            mask = collate([groups[i] for i in order[k : k + 8]])["attention_mask"]
            real, padded = real + int(mask.sum()), padded + mask.numel()
        return 1 - real / padded

    plain, bucketed = padding_share(False), padding_share(True)
    # measured 0.50 -> 0.36: what remains is padding among one query's documents, which share a batch
    assert bucketed < 0.8 * plain, (plain, bucketed)


def test_length_chunks_split_by_length_into_equal_groups():
    lengths = [5, 90, 7, 60, 6, 100, 8, 70]
    chunks = length_chunks(lengths, 2)
    assert chunks == [([0, 4, 2, 6], 8), ([3, 7, 1, 5], 100)]
    assert padded_slots(chunks) == 4 * 8 + 4 * 100 < 8 * 100
    assert length_chunks(lengths, 1) == [(sorted(range(8), key=lengths.__getitem__), 100)]
    assert len(length_chunks([3, 4], 8)) == 2  # never more chunks than rows


@pytest.mark.parametrize("model", ["tiny_lychee", "minilm_cross_encoder"])  # left- and right-padded kinds
def test_length_chunks_give_one_passs_logits_and_gradients(model, compose_cfg, tmp_path):
    # max_len 0: the whole pair (MiniLM's 96-token pair budget cuts every sample pair to one length)
    cfg = to_run_config(compose_cfg([f"model={model}", "model.dropout=0.0", "model.prompt.max_len=0"], tmp_path))
    encoder = load_inputs(cfg).encoder
    reranker = load_reranker(cfg.model, encoder, cfg.seed, training=True).eval()  # eval: no dropout; gradients flow
    queries = load_queries(SAMPLE, "data.train_file", 6)
    batch = encoder.pad([encoder.encode("Find the docs", q.query, d) for q in queries for d in [*q.pos, *q.neg][:3]])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    chunks = length_chunks(mask.sum(-1).tolist(), 3)
    assert padded_slots(chunks) < mask.numel()  # the sample's lengths vary: chunks compute fewer slots
    results = []
    for plan in (None, chunks):
        reranker.zero_grad()
        logits = reranker(ids, mask, chunks=plan)
        (logits * torch.linspace(-1, 1, len(logits))).sum().backward()  # a loss that tells rows apart
        grads = [p.grad.clone() for p in reranker.parameters() if p.grad is not None]
        results.append((logits.detach(), grads))
    (one, one_grads), (chunked, chunked_grads) = results
    assert torch.allclose(one, chunked, atol=1e-5), (one - chunked).abs().max()
    assert len(one_grads) == len(chunked_grads) > 0
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(one_grads, chunked_grads))
