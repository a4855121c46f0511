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


NCCL_ONE_GPU = """
import os, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1,
                        device_id=torch.device("cuda:0"))
assert dist.get_backend() == "nccl"
total = torch.full((4,), 2.0, device="cuda:0")
dist.all_reduce(total)
torch.manual_seed(0)
plain = torch.nn.Linear(8, 1).cuda()
wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1).cuda(), device_ids=[0])
wrapped.module.load_state_dict(plain.state_dict())
x = torch.randn(16, 8, device="cuda:0")
plain(x).pow(2).mean().backward()
wrapped(x).pow(2).mean().backward()  # DDP's gradient all-reduce over NCCL (one rank: the mean is the gradient)
torch.cuda.synchronize()
same = all(torch.allclose(a.grad, b.grad) for a, b in zip(plain.parameters(), wrapped.module.parameters()))
print("nccl", total.tolist(), same, flush=True)
dist.destroy_process_group()
"""


def test_nccl_process_group_on_one_gpu():
    """What one GPU can show of NCCL: a process group on the nccl backend, an all-reduce and DDP's gradient
    all-reduce through it. (lychee_exp itself starts no process group for one rank; NCCL between two or more GPUs
    is exercised by test_ddp_on_gpus_uses_nccl only on a machine with several GPUs.)"""
    import os
    import subprocess
    import sys

    from lychee_exp.launch.processes import free_port

    env = {**os.environ, "PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", NCCL_ONE_GPU], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["nccl", "[2.0,", "2.0,", "2.0,", "2.0]", "True"], proc.stdout


def test_data_parallel_matches_one_gpu(tmp_path):
    """DataParallel over every GPU with batch b per GPU trains as one GPU with batch b x GPUs: the same losses and
    pre-clip gradient norms per step, and the same weights (GPU kernels: a looser tolerance than on CPU)."""
    from equivalence import assert_same_training

    count = torch.cuda.device_count()
    single, dp = tmp_path / "single", tmp_path / "dp"
    run_tiny(single, "parallel=single", f"data.batch_size={2 * count}", "model.dropout=0.0")
    run_tiny(dp, "parallel=dp", "gpus=auto", "data.batch_size=2", "model.dropout=0.0")
    assert_same_training(dp, single, rtol=1e-3)
