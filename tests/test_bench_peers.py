"""The peer benchmark's mechanism: every system gets lychee_exp's own batches and trains the same model the same
way (figures are the benchmark's business, not the tests')."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from lychee_exp.bench.peer_batches import build_steps  # noqa: E402
from lychee_exp.bench.peer_loops import Settings, hf_trainer, torch_loop  # noqa: E402
from lychee_exp.bench.peers import markdown_table, summarize, timed_row  # noqa: E402

TINY = [
    "model=tiny_lychee",
    "loss=pointwise",
    "data=sample",
    "data.batch_size=2",
    "data.train_group_size=4",
    "data.random_negatives=1",
    "model.dropout=0.0",
    "trainer.precision=fp32",
    "optimizer.lr=1e-3",
]


def test_peers_get_lychee_exps_batches_and_the_same_gradient(tmp_path):
    """The benchmark's steps are the batches lychee_exp's own Trainer loads (its loader, not a rebuilt one), and
    the bare loop's backward on a batch gives the gradient lychee_exp's training step gives: the same work."""
    from lychee_exp.core.config import to_run_config
    from lychee_exp.core.devices import plan_devices
    from lychee_exp.core.distributed import DistEnv
    from lychee_exp.recipe.trainer import Trainer
    from lychee_exp.testing.jobs import compose_job

    _, _, model, steps = build_steps(TINY, tmp_path, 3)
    overrides = [*TINY, "parallel=single", "gpus=1", "logger=none", "data.bucket_by_length=false"]
    cfg = to_run_config(compose_job([*overrides, "trainer.max_steps=3"], tmp_path))
    trainer = Trainer(cfg, DistEnv(), plan_devices("single", 1, cuda_count=0, cpu_threads_per_rank=1), tmp_path)
    trainer.setup()
    trainer.data.sampler.set_epoch(0)
    trainer.data.train_set.set_epoch(0)
    batches = [batch for batch, _ in zip(trainer.data.loader, steps)]
    assert len(batches) == 3
    for step, batch in zip(steps, batches):
        assert torch.equal(step.input_ids, batch["input_ids"])
        assert torch.equal(step.attention_mask, batch["attention_mask"])
        assert step.labels.tolist() == [1.0, 0, 0, 0] * 2 and len(step.pairs) == 8

    trainer.model.load_state_dict(model.state_dict())
    trainer.step.accumulate(iter(batches[:1]), 1, 2)
    lychee = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    bare: dict[str, torch.Tensor] = {}

    def catch(name: str):
        def hook(param: torch.Tensor) -> None:
            bare.setdefault(name, param.grad.clone())

        return hook

    for name, param in model.named_parameters():  # the bare loop's gradient, caught before it steps and clears
        param.register_post_accumulate_grad_hook(catch(name))
    torch_loop(model, steps[:1], Settings(1e-3, 0.0, 1.0, 42, torch.device("cpu")))
    assert lychee.keys() == bare.keys() and lychee
    for name in lychee:
        torch.testing.assert_close(bare[name], lychee[name], rtol=1e-4, atol=1e-7, msg=name)
    trainer.cleanup()


def test_hf_trainer_and_bare_loop_take_the_same_steps(tmp_path):
    """Same weights, batches, AdamW, schedule and clipping: both loops end at the same weights."""
    _, encoder, model, steps = build_steps(TINY, tmp_path, 3)
    settings = Settings(1e-3, 0.0, 1.0, 42, torch.device("cpu"))
    twin = copy.deepcopy(model)
    bare = torch_loop(model, steps, settings)
    hf = hf_trainer(twin, steps, settings, encoder, str(tmp_path / "hf"))
    assert len(bare["ends"]) == len(hf["ends"]) == 3
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4, msg=name)
    before = build_steps(TINY, tmp_path, 1)[2]
    moved = sum(not torch.equal(a, b) for a, b in zip(before.parameters(), model.parameters()))
    assert moved > 0  # the steps trained
    row = timed_row(bare, steps, 1, settings.device)
    real = sum(int(s.attention_mask.sum()) for s in steps[1:])
    assert row["tokens_per_s"] > 0 and row["pairs_per_s"] > 0
    assert row["padding_share"] == pytest.approx(1 - real / sum(s.attention_mask.numel() for s in steps[1:]))


def test_summary_compares_with_the_fastest_peer():
    plan = [
        {"system": "torch_loop", "processes": 1, "threads": 2},
        {"system": "lychee_single", "processes": 1, "threads": 2},
    ]
    runs = {
        "torch_loop": [{"pairs_per_s": 1, "tokens_per_s": 100, "padding_share": 0.2, "peak_memory_mb": 1}] * 2,
        "lychee_single": [
            {"pairs_per_s": 1, "tokens_per_s": v, "padding_share": 0.1, "peak_memory_mb": 1} for v in (90, 130, 120)
        ],
    }
    rows = summarize(plan, runs)
    assert [r["vs_fastest_peer"] for r in rows] == [1.0, 1.2]  # the median over rounds, over the best peer
    assert "| lychee_single | 1 x 2 |" in markdown_table(rows)


def test_the_longtail_file_is_long_tailed_and_reproducible(tmp_path):
    import json
    import statistics

    from lychee_exp.bench.peer_batches import longtail_file

    first = longtail_file(tmp_path, 200).read_text()
    assert longtail_file(tmp_path, 200).read_text() == first  # the same seed writes the same file
    rows = [json.loads(line) for line in first.splitlines()]
    assert len(rows) == 200 and all(len(r["pos"]) == 1 and len(r["neg"]) == 3 for r in rows)
    words = [len(d.split()) for r in rows for d in r["pos"] + r["neg"]]
    # ~0.6 words per token: 16 words up to 2048 tokens' worth; a median near 100 tokens, a tail 10x longer
    assert min(words) >= 16 and max(words) <= int(2048 * 0.6)
    assert 30 <= statistics.median(words) <= 80 and max(words) > 10 * statistics.median(words)
