"""Speed levers on the CPU: tokenize once per run, gradient checkpointing `auto`, the LoRA dtype path, fused AdamW,
cuBLAS's workspace setting for deterministic mode, compiled decoder layers."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, TINY_OVERRIDES, TINY_QWEN2, compose_config
from torch.utils._python_dispatch import TorchDispatchMode

from lychee_exp.config.schema import OptimizerConfig, to_run_config
from lychee_exp.errors import UserError
from lychee_exp.model.reranker import apply_levers, load_reranker
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.parallel.memory_plan import activation_bytes, resolve_checkpointing
from lychee_exp.train.inputs import load_inputs
from lychee_exp.train.optim import adamw
from lychee_exp.train.trainer import Trainer

QWEN25_1P5B_SHAPE = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "vocab_size": 151936}


def run_config(tmp_path, *extra):
    return to_run_config(compose_config([*TINY_OVERRIDES, *extra], tmp_path))


class CountingTokenizer:
    """Delegates to a tokenizer and counts its calls (the call operator is looked up on the type)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("pretokenize", [True, False])
def test_fit_does_not_tokenize_when_pretokenized(pretokenize, tmp_path):
    cfg = run_config(tmp_path, f"data.pretokenize={str(pretokenize).lower()}", "trainer.max_steps=3")
    trainer = Trainer(cfg, DistEnv(), plan_devices("single", 1, cpu_threads_per_rank=1), tmp_path)
    trainer.setup()
    counter = CountingTokenizer(trainer.encoder.tokenizer)
    trainer.encoder.tokenizer = counter  # the one encoder every batch (and evaluation) goes through
    try:
        metrics = trainer.fit()
    finally:
        trainer.encoder.tokenizer = counter.tokenizer
        trainer.cleanup()
    assert metrics["steps"] == 3
    if pretokenize:
        assert counter.calls == 0
    else:
        assert counter.calls > 0  # the collator tokenizes in the step: what pretokenize takes off it


def test_pretokenized_batches_equal_tokenized_ones(tmp_path):
    """The cache returns exactly what the encoder would: the same batches, so the same run."""
    from lychee_exp.data.groups import GroupCollator, TrainGroups
    from lychee_exp.data.token_cache import pretokenized

    cfg = run_config(tmp_path)
    inputs = load_inputs(cfg)
    groups = TrainGroups(inputs.train_queries, 4, "an instruction", seed=1)
    cached = pretokenized(inputs.encoder, groups, {})
    for items in ([groups[0], groups[1]], [groups[2], groups[3]]):
        plain, fast = GroupCollator(inputs.encoder)(items), GroupCollator(cached)(items)
        assert torch.equal(plain["input_ids"], fast["input_ids"])
        assert torch.equal(plain["attention_mask"], fast["attention_mask"])


def shape_model(tmp_path: Path) -> str:
    model = tmp_path / "shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **QWEN25_1P5B_SHAPE}))
    return str(model)


@pytest.mark.parametrize(
    "rows, width, free_gib, expected",
    [(8, 2048, 139, False), (8, 2048, 20, True), (64, 4096, 139, True)],
)
def test_checkpointing_auto_follows_free_memory(rows, width, free_gib, expected, tmp_path, monkeypatch):
    cfg = run_config(
        tmp_path,
        f"model.path={shape_model(tmp_path)}",
        "model.gradient_checkpointing=auto",
        "model.dtype=bfloat16",
        "model.lora.enabled=true",
        "data.batch_size=1",
        f"data.train_group_size={rows}",
        f"model.prompt.max_len={width}",
    )
    encoder = load_inputs(run_config(tmp_path)).encoder  # the tiny tokenizer; prompt budget from cfg below
    encoder.prompt = cfg.model.prompt
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * 2**30, 141 * 2**30))
    on, why = resolve_checkpointing(cfg, encoder, torch.device("cuda", 0))
    assert on is expected, why
    assert resolve_checkpointing(cfg, encoder, torch.device("cpu")) == (False, "auto: CPU")


def test_activation_estimate_orders_the_paths(tmp_path):
    model = run_config(tmp_path, "model.lora.enabled=true", "model.dtype=bfloat16").model
    full = activation_bytes(QWEN25_1P5B_SHAPE, model, 16384, False, "bf16")
    assert 20 * 2**30 < full < 120 * 2**30  # 16k tokens of a 1.5B model without checkpointing: tens of GiB
    assert activation_bytes(QWEN25_1P5B_SHAPE, model, 16384, True, "bf16") < full / 10
    model.lora.dtype = "float32"  # peft's upcast keeps a float32 copy of every adapter input
    assert activation_bytes(QWEN25_1P5B_SHAPE, model, 16384, False, "bf16") > full


class CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def draw_lora_b(model: torch.nn.Module, seed: int = 5) -> None:
    """lora_B is zero at init, so the adapters add nothing whatever their path: drawn, they change the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.2)


def lora_model(tmp_path, lora_dtype: str):
    cfg = run_config(tmp_path, "model.lora.enabled=true", "model.dtype=bfloat16", f"model.lora.dtype={lora_dtype}")
    inputs = load_inputs(cfg)
    model = load_reranker(cfg.model, inputs.encoder, seed=3)
    draw_lora_b(model)
    apply_levers(model, cfg.model, "bf16", torch.device("cpu"))
    batch = inputs.encoder.pad([inputs.encoder.encode("i", "a query", "a document about it" * n) for n in (1, 3)])
    return model.eval(), batch


def logits_and_grads(model, batch, counter=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.autocast("cpu", dtype=torch.bfloat16), counter or contextlib.nullcontext():
        logits = model(batch["input_ids"], batch["attention_mask"])
    (logits.float() * torch.tensor([1.0, -0.5])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_lora_auto_computes_in_bf16_without_upcasts(tmp_path):
    """auto keeps float32 adapter weights but skips peft's cast of each input to float32: under autocast the
    adapter matmuls ran in bf16 either way, so the logits and the adapters' gradients are the same, the casts
    fewer. (lora_B drawn: with lora_B = 0 the adapters would add nothing.)"""
    logits, grads, casts = {}, {}, {}
    for mode in ("float32", "auto"):
        model, batch = lora_model(tmp_path, mode)
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
        counter = CountCasts()
        logits[mode], grads[mode] = logits_and_grads(model, batch, counter)
        casts[mode] = counter.casts
    assert torch.equal(logits["auto"], logits["float32"])
    assert grads["auto"].keys() == grads["float32"].keys() and any("lora_A" in n for n in grads["auto"])
    for name, grad in grads["float32"].items():
        assert torch.equal(grads["auto"][name], grad), name
    assert casts["auto"] < casts["float32"]
    # the drawn adapters matter: without them the logits move
    plain, batch = lora_model(tmp_path, "auto")
    for name, p in plain.named_parameters():
        if "lora_B" in name:
            p.data.zero_()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.allclose(plain(batch["input_ids"], batch["attention_mask"]), logits["auto"], atol=1e-2)


def test_lora_model_dtype_puts_adapters_in_bf16(tmp_path):
    model, _ = lora_model(tmp_path, "model")
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.bfloat16}


def test_fused_adamw_is_on_by_default_and_steps_like_the_foreach_kernel():
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(3)]
    after = {}
    for fused in (None, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = adamw(params, 1e-2, OptimizerConfig(fused=fused))
        assert optimizer.defaults["fused"] is (fused is None)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        after[fused] = params
    # the same update: three steps move every weight by ~3e-2, the kernels agree to float32 rounding
    for fused, foreach in zip(after[None], after[False]):
        assert torch.allclose(fused, foreach, rtol=0, atol=1e-6)
    assert not torch.allclose(after[None][0], start[0], atol=1e-2)


def test_bad_lever_values_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="model.gradient_checkpointing"):
        run_config(tmp_path, "model.gradient_checkpointing=sometimes")
    with pytest.raises(UserError, match="model.lora.dtype"):
        run_config(tmp_path, "model.lora.dtype=int8")
    cfg = run_config(tmp_path, "model.liger_kernel=true")
    with pytest.raises(UserError, match="model.liger_kernel"):
        apply_levers(torch.nn.Linear(2, 2), cfg.model, "fp32", torch.device("cpu"))


def test_every_training_process_gets_the_cublas_workspace_setting():
    """Set on import of the recipe every training process runs (train_on_rank), before any GEMM; a user's value wins."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    code = "import os, lychee_exp.train.trainer; print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == ":4096:8", out.stderr[-2000:]
    env["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == ":16:8"


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_same_logits(tmp_path):
    cfg = run_config(tmp_path, "model.compile_layers=true")
    inputs = load_inputs(cfg)
    batch = inputs.encoder.pad([inputs.encoder.encode("i", "q", "a document"), inputs.encoder.encode("i", "q", "d")])
    plain = load_reranker(cfg.model, inputs.encoder, seed=3).eval()
    compiled = apply_levers(
        load_reranker(cfg.model, inputs.encoder, seed=3).eval(), cfg.model, "fp32", torch.device("cpu")
    )
    with torch.no_grad():
        expected = plain(batch["input_ids"], batch["attention_mask"])
        got = compiled(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert TINY_QWEN2.is_dir()
