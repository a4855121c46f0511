"""Devices for a DDP job: the GPU-count checks, parallel=dp without CUDA, and trainer.global_batch_size, which
trains the same steps on one device (accumulating) and on two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_metrics, warm_ranks_kept
from ddp_helpers import TINY_DDP, run_losses, run_weights
from equivalence import assert_same_training

from lychee_exp.errors import UserError
from lychee_exp.job.in_process import run_job
from lychee_exp.parallel.devices import plan_devices


def test_gpu_count_checks():
    with pytest.raises(UserError, match=r"gpus=4 but only 2 CUDA GPU"):
        plan_devices("ddp", 4, cuda_count=2, cores=16)
    with pytest.raises(UserError, match=r"parallel=dp needs CUDA GPUs"):
        plan_devices("dp", "auto", cuda_count=0, cores=2)
    assert plan_devices("ddp", "auto", cuda_count=4, cores=16).num_devices == 4
    cpu = plan_devices("ddp", 3, cuda_count=0, cores=6)
    assert (cpu.device_type, cpu.num_devices, cpu.threads_per_rank) == ("cpu", 3, 2)
    assert plan_devices("ddp", "auto", cuda_count=0, cores=2).num_devices == 2
    # one process: every core unless parallel.cpu_threads_per_rank says otherwise (the 1 x 1 thread baseline)
    assert plan_devices("single", 1, cuda_count=0, cores=2).threads_per_rank == 2
    assert plan_devices("single", 1, cuda_count=0, cores=2, cpu_threads_per_rank=1).threads_per_rank == 1


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("fpu avx2 avx512f avx512_bf16 avx512_vnni", "bf16"),
        ("fpu amx_bf16 amx_tile", "bf16"),
        ("fpu avx2 avx512f", "fp32"),
    ],
)
def test_auto_precision_on_a_cpu_is_bf16_only_where_it_computes_bf16_natively(tmp_path, monkeypatch, flags, expected):
    """AVX-512 without its bf16 instructions emulates bf16 (slower than fp32): such a CPU stays fp32."""
    from lychee_exp.model import precision

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    monkeypatch.setattr(precision.cpu_computes_bf16, "__defaults__", (str(cpuinfo),))
    assert precision.resolve_precision("auto", torch.device("cpu")) == expected
    assert precision.resolve_precision("fp32", torch.device("cpu")) == "fp32"  # what the user pins stays
    assert precision.cpu_computes_bf16(str(tmp_path / "absent")) is False  # no /proc (macOS, Windows)


def test_dp_without_cuda_is_one_line(tmp_path):
    """The job stops with a user error before any training (the CLI's exit 2 and one line for a user error are
    tested once, in tests/test_data.py and tests/test_config.py: here in-process, without a subprocess)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="parallel=dp needs CUDA GPUs") as info:
        run_job(["parallel=dp"], tmp_path)
    assert "\n" not in str(info.value) and not (tmp_path / "metrics.json").exists()


def _global_batch_run(tmp_path: Path, name: str, gpus: int, *extra: str) -> Path:
    run_dir = tmp_path / name
    run_job(
        [*TINY_DDP, "parallel=ddp", f"gpus={gpus}", "data.batch_size=2", "trainer.global_batch_size=4", *extra], run_dir
    )
    return run_dir


def test_a_global_batch_trains_the_same_steps_on_one_device_and_on_two(tmp_path):
    """A sweep trial may land on a 1-device or a 2-device slot: trainer.global_batch_size makes the 1-device run
    accumulate 2 micro-batches, and both train the same steps: losses (1e-5 relative) and every parameter's
    gradient."""
    sgd = ["optimizer.name=sgd", "optimizer.weight_decay=0", "optimizer.max_grad_norm=0", "optimizer.warmup_ratio=0"]
    sgd += ["optimizer.scheduler=constant", "trainer.max_steps=1"]
    with warm_ranks_kept():  # the 1-device runs first, then the 2-device ones: one start of ranks for each setup
        one, w0, g1 = (
            _global_batch_run(tmp_path, "one", 1),
            _global_batch_run(tmp_path, "w0", 1, *sgd, "optimizer.lr=1e-30"),
            _global_batch_run(tmp_path, "g1", 1, *sgd, "optimizer.lr=1"),
        )
        two, g2 = _global_batch_run(tmp_path, "two", 2), _global_batch_run(tmp_path, "g2", 2, *sgd, "optimizer.lr=1")
    m_one, m_two = run_metrics(one), run_metrics(two)
    assert (m_one["num_devices"], m_one["grad_accum_steps"]) == (1, 2)
    assert (m_two["num_devices"], m_two["grad_accum_steps"]) == (2, 1)
    assert m_one["effective_batch_size"] == m_two["effective_batch_size"] == 4
    assert run_losses(two) == pytest.approx(run_losses(one), rel=1e-5)
    assert_same_training(two, one, rtol=1e-5)
    # per-parameter gradients of the first step: plain SGD at lr 1 without clipping makes w1 = w0 - g, and w0 is
    # a run whose lr is too small to move any weight
    w0 = run_weights(w0)
    g_one = {k: w0[k] - w for k, w in run_weights(g1).items()}
    g_two = {k: w0[k] - w for k, w in run_weights(g2).items()}
    assert g_one.keys() == g_two.keys() == w0.keys()
    assert sum(bool(g.abs().max() > 0) for g in g_one.values()) > len(g_one) // 2  # the step moved the weights
    for key in g_one:
        torch.testing.assert_close(g_two[key], g_one[key], rtol=1e-4, atol=1e-6, msg=key)


def test_a_global_batch_that_does_not_divide_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"trainer.global_batch_size=6 is not a multiple of data.batch_size=2 x 2"):
        run_job([*TINY_DDP, "parallel=ddp", "gpus=2", "data.batch_size=2", "trainer.global_batch_size=6"], tmp_path)


def test_a_global_batch_with_a_token_budget_is_one_line(tmp_path):
    """A token budget's steps hold a varying number of queries, so a fixed global batch cannot be reached: the
    line names the key that can (trainer.global_tokens_per_step); which needs a budget, and must divide."""
    budget = ["parallel=ddp", "gpus=2", "data.max_tokens_per_batch=4096"]
    with pytest.raises(UserError, match=r"global_batch_size=4 counts queries .*max_tokens_per_batch=4096.*tokens_per"):
        run_job([*TINY_DDP, *budget, "trainer.global_batch_size=4"], tmp_path)
    with pytest.raises(UserError, match=r"^trainer.global_tokens_per_step=8192 needs a token budget"):
        run_job([*TINY_DDP, "parallel=ddp", "gpus=2", "trainer.global_tokens_per_step=8192"], tmp_path)
    with pytest.raises(UserError, match=r"global_tokens_per_step=12288 is not a multiple of .*=4096 x 2 device"):
        run_job([*TINY_DDP, *budget, "trainer.global_tokens_per_step=12288"], tmp_path)
    with pytest.raises(UserError, match=r"global_batch_size=4 and trainer.global_tokens_per_step=8192 both"):
        run_job([*TINY_DDP, *budget, "trainer.global_batch_size=4", "trainer.global_tokens_per_step=8192"], tmp_path)
