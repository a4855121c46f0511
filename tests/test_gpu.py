"""Mixed precision on a CUDA GPU: bf16 autocast, and fp16 with a GradScaler."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUMERIC = ("ndcg@10", "mrr@10", "initial_ndcg@10", "train_loss", "train_samples_per_s")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_run_completes(precision, tmp_path):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    _, metrics = run_tiny(tmp_path, f"trainer.precision={precision}", "trainer.max_steps=6")
    assert metrics["precision"] == precision
    assert metrics.get("device_type", "cuda") == "cuda"
    assert metrics["steps"] == 6
    for key in NUMERIC:
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert 0.0 <= metrics["ndcg@10"] <= 1.0


def test_auto_precision_on_gpu_is_mixed(tmp_path):
    _, metrics = run_tiny(tmp_path, "trainer.precision=auto", "trainer.max_steps=2")
    assert metrics["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")


def test_ddp_on_gpus_uses_nccl(tmp_path):
    _, metrics = run_tiny(tmp_path, "parallel=ddp", "gpus=auto", "trainer.max_steps=4")
    assert metrics["num_devices"] == torch.cuda.device_count()
    assert metrics["device_type"] == "cuda" and metrics["device"] == torch.cuda.get_device_name(0)
    if torch.cuda.device_count() > 1:
        assert metrics["backend"] == "nccl"
    assert min(metrics["peak_memory_mb_per_rank"]) > 0
    assert math.isfinite(metrics["ndcg@10"])


def test_data_parallel_runs_on_all_gpus(tmp_path):
    _, metrics = run_tiny(tmp_path, "parallel=dp", "gpus=auto", "trainer.max_steps=4")
    count = torch.cuda.device_count()
    assert metrics["strategy"] == "dp" and metrics["num_devices"] == count
    assert metrics["effective_batch_size"] == metrics["per_device_batch_size"] * count
    assert math.isfinite(metrics["ndcg@10"])
