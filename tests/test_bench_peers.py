"""The peer benchmark's mechanism: every system gets lychee_exp's own batches and trains the same model the same
way, in each precision under test, compared only within a precision (figures are the benchmark's business, not
the tests')."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import harness, peers  # noqa: E402
from benchmarks.peer_batches import build_steps  # noqa: E402
from benchmarks.peer_loops import Settings, hf_trainer, timed_row, torch_loop  # noqa: E402
from benchmarks.peers import markdown_table, summarize  # noqa: E402

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
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.job.in_process import compose_job
    from lychee_exp.parallel.devices import plan_devices
    from lychee_exp.parallel.distributed import DistEnv
    from lychee_exp.train.trainer import Trainer

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


def _output_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    """The dtype of every output of the model's first Linear layer from now on (what its matmuls computed in)."""
    seen: list[torch.dtype] = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("bf16", [False, True])
def test_each_peer_computes_in_the_precision_under_test(tmp_path, bf16):
    """bf16 rows: the bare loop under autocast, the Trainer with bf16=True; fp32 rows: neither."""
    _, encoder, model, steps = build_steps(TINY, tmp_path, 2)
    settings = Settings(1e-3, 0.0, 1.0, 42, torch.device("cpu"), bf16)
    twin = copy.deepcopy(model)
    bare, hf = _output_dtypes(model), _output_dtypes(twin)
    torch_loop(model, steps, settings)
    hf_trainer(twin, steps, settings, encoder, str(tmp_path / "hf"))
    expected = torch.bfloat16 if bf16 else torch.float32
    assert bare and hf and set(bare) == set(hf) == {expected}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # mixed precision: fp32 weights


def test_flag_embedding_trains_on_the_same_batches_in_both_precisions(tmp_path):
    """FlagEmbedding's model and Trainer read exactly the benchmark's batches (token ids, BERT segment ids), take
    every step, move the weights and count the batches' non-pad tokens, in fp32 and in bf16."""
    pytest.importorskip("FlagEmbedding")
    from benchmarks.flag_peer import identical_batches

    overrides = ["model=minilm_cross_encoder", *[o for o in TINY if not o.startswith("model=")]]
    _, encoder, model, steps = build_steps(overrides, tmp_path, 2)
    seen = []
    model.backbone.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    dtypes = _output_dtypes(model)
    for bf16 in (False, True):
        seen.clear()
        before = copy.deepcopy(model.state_dict())
        settings = Settings(1e-3, 0.0, 1.0, 42, torch.device("cpu"), bf16)
        result = identical_batches(model, steps, settings, encoder, 4, str(tmp_path / f"flag{bf16}"))
        assert len(result["ends"]) == 2 and len(seen) == 2
        for step, fed in zip(steps, seen):
            assert torch.equal(fed["input_ids"], step.input_ids)
            assert torch.equal(fed["attention_mask"], step.attention_mask)
            assert fed["token_type_ids"].sum() > 0  # (query, document) pairs: the document is segment 1
        assert result["tokens"] == sum(int(s.attention_mask.sum()) for s in steps)
        assert result["padded"] == sum(s.attention_mask.numel() for s in steps)
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it trained
        assert dtypes[-1] == (torch.bfloat16 if bf16 else torch.float32)


def test_every_system_runs_in_every_precision(tmp_path, monkeypatch):
    """The plan: every system once per precision, each run told its precision (last, after the command line's
    overrides); the cross-encoder peers on the sample mix only."""
    calls = []

    def fake_child(module, system, spec, env):
        calls.append((system, spec))
        return {"pairs_per_s": 1.0, "tokens_per_s": 1.0, "padding_share": 0.0, "peak_memory_mb": 1.0}

    monkeypatch.setattr(harness, "run_child", fake_child)
    rows = peers.measure("sample", ["fp32", "bf16"], ["trainer.precision=fp32"], tmp_path, 1, 1, 8)
    names = [s["system"] for s in peers.systems("sample", 2, 0)]
    assert {"st_cross_encoder", "flag_embedding"} <= set(names)
    assert [(r["system"], r["precision"]) for r in rows] == [(n, p) for p in ("fp32", "bf16") for n in names]
    assert sorted((system, spec["precision"]) for system, spec in calls) == sorted(
        (n, p) for n in names for p in ("fp32", "bf16")
    )
    assert all(spec["overrides"][-1] == f"trainer.precision={spec['precision']}" for _, spec in calls)
    assert not {"st_cross_encoder", "flag_embedding"} & {s["system"] for s in peers.systems("longtail", 2, 0)}


def test_summary_compares_with_the_fastest_peer_of_the_same_precision():
    plan = [
        {"system": system, "precision": precision, "processes": 1, "threads": 2}
        for precision in ("fp32", "bf16")
        for system in ("torch_loop", "lychee_single")
    ]

    def runs(*values):
        return [{"pairs_per_s": 1, "tokens_per_s": v, "padding_share": 0.1, "peak_memory_mb": 1} for v in values]

    results = {
        "torch_loop:fp32": runs(100, 100),
        "lychee_single:fp32": runs(90, 130, 120),
        "torch_loop:bf16": runs(300),
        "lychee_single:bf16": runs(150),
    }
    rows = summarize(plan, results)
    assert [(r["system"], r["precision"]) for r in rows] == [(p["system"], p["precision"]) for p in plan]
    # the median over rounds, over the best peer of its own precision: against the faster bf16 peer the fp32
    # lychee row would read 0.4, and the bf16 one against the fp32 peer 1.5
    assert [r["vs_fastest_peer"] for r in rows] == [1.0, 1.2, 1.0, 0.5]
    assert "| lychee_single | bf16 | 1 x 2 |" in markdown_table(rows)
    results["torch_loop:bf16"] = []  # no bf16 peer ran: its rows have no ratio rather than one to an fp32 peer
    rows = summarize(plan, results)
    assert rows[-1]["precision"] == "bf16" and math.isnan(rows[-1]["vs_fastest_peer"])


def test_the_longtail_file_is_long_tailed_and_reproducible(tmp_path):
    import json
    import statistics

    from benchmarks.peer_batches import longtail_file

    first = longtail_file(tmp_path, 200).read_text()
    assert longtail_file(tmp_path, 200).read_text() == first  # the same seed writes the same file
    rows = [json.loads(line) for line in first.splitlines()]
    assert len(rows) == 200 and all(len(r["pos"]) == 1 and len(r["neg"]) == 3 for r in rows)
    words = [len(d.split()) for r in rows for d in r["pos"] + r["neg"]]
    # ~0.6 words per token: 16 words up to 2048 tokens' worth; a median near 100 tokens, a tail 10x longer
    assert min(words) >= 16 and max(words) <= int(2048 * 0.6)
    assert 30 <= statistics.median(words) <= 80 and max(words) > 10 * statistics.median(words)
