"""launch/gpu_check.py: its FLOP accounting and timed window on hand-made inputs, its time budget, and (slow) the
whole check end to end on the CPU with the tiny model (--tiny), read back from its JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT

from lychee_exp.bench.gpu.check import Budget, Runner
from lychee_exp.bench.gpu.flops import QWEN25_1P5B, Shape, step_flops
from lychee_exp.bench.gpu.timing import BatchLog, WindowClock, forward_rows, window_figures

SHAPE = Shape.of(QWEN25_1P5B)


def test_model_flops_are_the_project_formula_plus_the_adapters():
    n = SHAPE.non_embedding
    assert n == pytest.approx(1.31e9, rel=0.01)  # Qwen2.5-1.5B without embeddings
    attention = 4 * 28 * 1536 * 2048
    model, hardware = step_flops(SHAPE, 0, [([2048], [2048])], checkpointing=False)
    assert model == hardware == 2048 * (4 * n + 3 * attention)
    lora = SHAPE.lora_params(64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert lora == 28 * 64 * (1536 * 2 + (1536 + 256) * 2 + 1536 * 2 + (1536 + 8960) * 3)
    with_lora, recomputed = step_flops(SHAPE, lora, [([2048], [2048])], checkpointing=True)
    assert with_lora == model + 2048 * 6 * lora
    assert recomputed == with_lora + 2048 * (2 * n + 2 * lora + attention)  # one more forward per layer


def test_padding_counts_for_the_hardware_only():
    model, hardware = step_flops(SHAPE, 0, [([100, 300], [300, 300])], checkpointing=False)
    exact, _ = step_flops(SHAPE, 0, [([100, 300], [100, 300])], checkpointing=False)
    assert model == exact < hardware


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
