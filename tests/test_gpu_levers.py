"""Speed levers on a CUDA GPU: deterministic mode without a warning per GEMM, fused AdamW by default, checkpointing
`auto` off when memory allows, the LoRA adapters' bf16 path, compiled decoder layers and Liger kernels giving the
logits and adapter gradients of the plain model (lora_B drawn, not zero)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TINY_OVERRIDES, compose_config
from test_levers import draw_lora_b

from lychee_exp.config.schema import OptimizerConfig, to_run_config
from lychee_exp.model.reranker import apply_levers, load_reranker
from lychee_exp.parallel.distributed import seed_everything
from lychee_exp.parallel.memory_plan import resolve_checkpointing
from lychee_exp.train.inputs import load_inputs
from lychee_exp.train.optim import adamw

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda", 0)


def run_config(tmp_path, *extra):
    return to_run_config(compose_config([*TINY_OVERRIDES, *extra], tmp_path))


def test_deterministic_mode_does_not_warn_per_gemm():
    seed_everything(0, deterministic=True)
    a = torch.randn(256, 256, device=CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            (a @ a).sum().item()
            torch.nn.functional.linear(a.bfloat16(), a.bfloat16()).sum().item()
    seed_everything(0, deterministic=False)


def test_adamw_is_fused_on_cuda_by_default():
    params = [torch.nn.Parameter(torch.zeros(3, device=CUDA))]
    assert adamw(params, 1e-3, OptimizerConfig()).defaults["fused"] is True


def test_checkpointing_auto_is_off_for_the_tiny_model(tmp_path):
    cfg = run_config(tmp_path, "model.gradient_checkpointing=auto")
    on, why = resolve_checkpointing(cfg, load_inputs(cfg).encoder, CUDA)
    assert on is False, why


def logits_and_grads(tmp_path, *extra) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the adapters' gradients of three rows, lora_B drawn (at its zero init the adapters add nothing,
    so a wrong adapter path would still give the plain model's logits)."""
    cfg = run_config(tmp_path, "model.lora.enabled=true", "model.dtype=bfloat16", *extra)
    inputs = load_inputs(cfg)
    model = load_reranker(cfg.model, inputs.encoder, seed=3)
    draw_lora_b(model)
    model = model.to(CUDA).eval()  # no dropout: the paths compared draw no masks
    apply_levers(model, cfg.model, "bf16", CUDA)
    batch = inputs.encoder.pad([inputs.encoder.encode("i", "a query", "a document about it" * n) for n in (1, 3, 5)])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(batch["input_ids"].to(CUDA), batch["attention_mask"].to(CUDA)).float()
    (out * torch.tensor([1.0, -0.5, 0.25], device=CUDA)).sum().backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    return out.detach().cpu(), grads


def assert_same(got, expected, tol: float) -> None:
    """Logits within tol (relative and absolute); every gradient within tol in relative norm."""
    torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        err = float((got[1][name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert err < tol, (name, err)


def test_lora_auto_path_gives_peft_float32_logits_and_gradients(tmp_path):
    assert_same(
        logits_and_grads(tmp_path, "model.lora.dtype=auto"),
        logits_and_grads(tmp_path, "model.lora.dtype=float32"),
        1e-3,
    )


def test_compiled_layers_give_the_same_logits_and_gradients(tmp_path):
    plain = logits_and_grads(tmp_path)
    assert_same(
        logits_and_grads(tmp_path, "model.compile_layers=true"), plain, 2e-2
    )  # bf16: fused kernels round differently


def test_liger_kernels_give_the_same_logits_and_gradients(tmp_path):
    pytest.importorskip("liger_kernel")
    assert_same(logits_and_grads(tmp_path, "model.liger_kernel=true"), logits_and_grads(tmp_path), 2e-2)
