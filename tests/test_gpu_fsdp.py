"""parallel=fsdp on a CUDA GPU, on one rank (FSDP2 over a 1-device mesh: every code path but the communication):
bf16 mixed precision (bf16 compute, fp32 gradient reduction) and CPU offload, against parallel=single."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_tiny
from equivalence import assert_same_training, step_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NO_DROPOUT = ["model.dropout=0.0", "trainer.max_steps=6"]


def test_bf16_mixed_precision_trains_as_single_within_bf16(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    run_tiny(tmp_path / "single", "trainer.precision=bf16", *NO_DROPOUT)
    _, m = run_tiny(tmp_path / "fsdp", "parallel=fsdp", "gpus=1", "trainer.precision=bf16", *NO_DROPOUT)
    assert m["strategy"] == "fsdp" and m["precision"] == "bf16" and m["device_type"] == "cuda"
    assert all(math.isfinite(m[k]) for k in ("ndcg@10", "train_loss"))
    # the weights are gathered in bf16 for every op (autocast alone keeps some in fp32): bf16's spacing apart
    single, fsdp = step_rows(tmp_path / "single"), step_rows(tmp_path / "fsdp")
    assert single.keys() == fsdp.keys()
    for step in single:
        assert fsdp[step]["loss"] == pytest.approx(single[step]["loss"], rel=3e-2), step
    assert m["param_bytes_per_rank"][0] > 0 and max(m["peak_memory_mb_per_rank"]) > 0


def test_cpu_offload_trains_as_without_it(tmp_path):
    run_tiny(tmp_path / "fsdp", "parallel=fsdp", "gpus=1", *NO_DROPOUT)
    _, m = run_tiny(tmp_path / "offload", "parallel=fsdp", "gpus=1", "parallel.cpu_offload=true", *NO_DROPOUT)
    assert m["strategy"] == "fsdp" and m["steps"] == 6
    # the same fp32 math with the optimizer stepping on the CPU: GPU and CPU kernels apart
    assert_same_training(tmp_path / "offload", tmp_path / "fsdp", rtol=1e-3, weights=False)
