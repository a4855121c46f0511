"""launch/gpu_check.py: its FLOP accounting and timed window on hand-made inputs, its time budget, and (slow) the
whole check end to end on the CPU with the tiny model (--tiny), read back from its JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, TINY_QWEN2
from torch.utils.flop_counter import FlopCounterMode

from lychee_exp.bench.gpu.check import Budget, Runner
from lychee_exp.bench.gpu.flops import QWEN25_1P5B, Shape, step_flops
from lychee_exp.bench.gpu.timing import BatchLog, WindowClock, forward_rows, window_figures

SHAPE = Shape.of(QWEN25_1P5B)


def counted_flops(tmp_path, lengths: list[int], checkpointing: bool) -> tuple[float, Shape, int]:
    """FlopCounterMode's count of one forward + backward of the tiny Qwen2 with LoRA (r=4, no dropout) on
    left-padded rows of `lengths`, the LM head's share left out (the formula leaves it out: one position per row).
    Eager attention: its matmuls are counted as bmm (the CPU's fused sdpa kernel has no FLOP rule). The
    embeddings' output is made to need a gradient so that the first layer's input gradient is computed, as the
    formula counts it (2N backward for every layer)."""
    from test_model import model_cfg

    from lychee_exp.core.model import build_encoder, load_reranker, load_tokenizer

    overrides = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.dropout=0.0"]
    overrides += ["model.attn_implementation=eager", f"model.gradient_checkpointing={str(checkpointing).lower()}"]
    cfg = model_cfg(tmp_path, *overrides)
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    model = load_reranker(cfg, encoder, 0).train()
    model.backbone.get_input_embeddings().register_forward_hook(lambda m, i, out: out.detach().requires_grad_())
    width = max(lengths)
    ids = torch.randint(5, 4000, (len(lengths), width))
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    with FlopCounterMode(display=False) as counter:
        model(ids, mask).sum().backward()
    counts = counter.get_flop_counts()
    total = sum(counts["Global"].values())
    head = sum(sum(ops.values()) for name, ops in counts.items() if name.endswith("lm_head"))
    shape = Shape.of(json.loads((TINY_QWEN2 / "config.json").read_text()))
    return total - head, shape, shape.lora_params(4, list(cfg.lora.target_modules))


def test_model_flops_equal_flop_counter_on_equal_rows(tmp_path):
    counted, shape, lora = counted_flops(tmp_path, [40, 40, 40], checkpointing=False)
    model, hardware = step_flops(shape, lora, [([40, 40, 40], [40, 40, 40])], checkpointing=False)
    assert model == hardware == pytest.approx(counted, rel=1e-9)


def test_padding_counts_for_the_hardware_only(tmp_path):
    counted, shape, lora = counted_flops(tmp_path, [12, 40, 25], checkpointing=False)
    model, hardware = step_flops(shape, lora, [([12, 40, 25], [40, 40, 40])], checkpointing=False)
    assert hardware == pytest.approx(counted, rel=1e-9)  # every padded slot computed, the real tokens' share less
    assert model < 0.8 * hardware


def test_recomputation_counts_for_the_hardware_only(tmp_path):
    counted, shape, lora = counted_flops(tmp_path, [40, 40], checkpointing=True)
    model, hardware = step_flops(shape, lora, [([40, 40], [40, 40])], checkpointing=True)
    # within 0.2%: the count has 512 FLOPs per token and layer more (an adapter-sized matmul the recomputation
    # adds), against the ~29k of one more forward that the formula adds
    assert hardware == pytest.approx(counted, rel=5e-3)
    plain, _ = step_flops(shape, lora, [([40, 40], [40, 40])], checkpointing=False)
    assert model == plain < hardware


def test_forward_rows_reads_padded_chunked_and_packed_batches():
    mask = torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    batch = {"input_ids": torch.zeros_like(mask), "attention_mask": mask}
    assert forward_rows(batch, 1) == ([1, 4, 2, 1], [4, 4, 4, 4], (4, 4))
    assert forward_rows(batch, 2) == ([1, 4, 2, 1], [1, 4, 4, 1], (4, 4))  # each chunk cut to its longest row
    packed = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "lengths": torch.tensor([5, 7])}
    assert forward_rows(packed, 1) == ([5, 7, 0], [5, 7, 4], (1, 16))  # the rounding pad computes, carries nothing


def test_window_counts_only_the_timed_batches():
    log = BatchLog()
    widths = [8, 8, 4, 4, 6]  # warm-up: the first two (8 wide); the window: 4, 4, 6 (two new shapes)
    for w in widths:
        log.add({"input_ids": torch.zeros(2, w), "attention_mask": torch.ones(2, w, dtype=torch.long)})
    clock = WindowClock(warmup=2, timed=3, device=torch.device("cpu"))
    clock.start, clock.end = 10.0, 12.0
    row = window_figures(log, clock, SHAPE, 0, False, peak_tflops=1000.0)
    assert row["timed_steps"] == 3 and row["warmup_steps"] == 2
    assert row["tokens_per_s"] == (2 * 4 + 2 * 4 + 2 * 6) / 2.0
    assert row["distinct_shapes"] == 3 and row["shapes_first_seen_in_window"] == 2
    model, _ = step_flops(SHAPE, 0, [([4, 4], [4, 4]), ([4, 4], [4, 4]), ([6, 6], [6, 6])], False)
    assert row["mfu"] == round(model / 2.0 / 1e15, 4)


def test_a_window_that_never_closed_is_an_error():
    clock = WindowClock(warmup=2, timed=30, device=torch.device("cpu"))
    clock.step_done(2)
    with pytest.raises(RuntimeError, match="before its timed window"):
        _ = clock.seconds


def test_a_run_that_does_not_fit_the_budget_is_skipped_without_starting(tmp_path):
    runner = Runner(tmp_path, tiny=True, warmup=1, timed=2, budget=Budget(10))
    row = runner.run("ours", "lora_1p5b_2048", min_s=60)
    assert "time budget" in row["skipped"] and runner.count == 0


@pytest.mark.slow
def test_tiny_dry_run_writes_every_key(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "launch/gpu_check.py", "--tiny", "--out", str(out), "--budget-s", "400"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["commit"] and report["mode"] == "tiny checks"
    checks = report["checks"]
    for name in ("lora_1p5b_512", "lora_1p5b_2048"):
        assert checks[name]["passed"] is True
        assert checks[name]["timed_steps"] == 2 and checks[name]["tokens_per_s"] > 0
        assert "mfu" in checks[name] and checks[name]["distinct_shapes"] == 1
    for mix in ("equal_lengths", "long_tailed"):
        entry = checks["hf_side_by_side"][mix]
        assert entry["ours_tokens_per_s"] > 0 and entry["hf_tokens_per_s"] > 0
        assert entry["ratio"] == pytest.approx(entry["ours_tokens_per_s"] / entry["hf_tokens_per_s"], rel=1e-2)
    # the same weights and batches: the first step's loss is the same number in both systems
    assert checks["hf_side_by_side"]["equal_lengths"]["first_loss_gap"] < 1e-4
    assert checks["hf_side_by_side"]["long_tailed"]["rows"]["ours"]["padding_share"] >= 0
    assert checks["gpu_tests"]["passed"] is True  # every GPU test skipped cleanly without CUDA


@pytest.mark.slow
def test_lychee_exp_and_hf_trainer_do_the_same_math(tmp_path):
    """Without LoRA dropout (whose masks come from different random streams) the two systems' losses agree step
    after step: same weights, batches, loss, AdamW settings, schedule and clipping."""
    runner = Runner(tmp_path, tiny=True, warmup=1, timed=4, budget=Budget(600))
    # one forward per batch, as HF does: forward chunks are other bf16 GEMM shapes (losses apart by ~3e-4)
    rows = [
        runner.run(system, "lora_1p5b_2048", min_s=1, overrides=["model.lora.dropout=0.0", "trainer.forward_chunks=1"])
        for system in ("ours", "hf")
    ]
    ours, hf = (row["first_losses"] for row in rows)
    assert len(ours) == len(hf) == 5
    assert ours == pytest.approx(hf, rel=1e-4)
    assert len(set(ours)) == 5  # the losses move: the comparison is not of a model that does not train
