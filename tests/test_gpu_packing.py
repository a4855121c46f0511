"""data.packing on a CUDA GPU with torch's real varlen (flash) kernel: packed rows of several prompts of different
lengths plus a padding segment give the padded batch's logits and per-parameter gradients within bf16 tolerance,
with LoRA adapters that add something (lora_B drawn, not zero); a mask that leaked across prompts would not."""

from __future__ import annotations

import pytest
import torch
from test_levers import draw_lora_b
from test_model import _spread_weights, model_cfg
from test_packing import _groups

from lychee_exp.data.groups import GroupCollator
from lychee_exp.model import packed as packed_rows
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda", 0)
LORA = ("model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0.0")
TOL = 2e-2  # relative error of bf16 operands: ~1e-3 to 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def models(tmp_path):
    cfg = model_cfg(tmp_path, *LORA, "model.dtype=bfloat16")
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    padded = load_reranker(cfg, encoder, 0)
    packed = load_reranker(cfg, encoder, 0, packing=True)
    _spread_weights(padded.backbone)
    draw_lora_b(padded)
    packed.load_state_dict(padded.state_dict())
    return encoder, padded.to(CUDA).eval(), packed.to(CUDA).eval()


def scores_and_grads(model, weights: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        scores = model(*args, **kwargs).float()
    (scores * weights).sum().backward()
    return scores.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def on_cuda(row: dict) -> dict:
    keys = ("position_ids", "cu_seqlens", "last_index", "max_length", "bounds")
    return {k: row[k].to(CUDA) if isinstance(row[k], torch.Tensor) else row[k] for k in keys}


def test_varlen_kernel_gives_padded_logits_and_gradients(tmp_path):
    works, why = packed_rows.varlen_probe(CUDA)
    assert works, why  # on a GPU the real kernel must run: the check's MFU is credited to it
    encoder, padded, packed = models(tmp_path)
    groups = _groups(3)  # 12 prompts of very different lengths
    plain = GroupCollator(encoder)(groups)
    row = GroupCollator(encoder, pack_multiple=64)(groups)
    lengths = row["lengths"].tolist()
    assert len(set(lengths)) > 3 and row["input_ids"].shape[1] > sum(lengths)  # a padding segment at the end
    weights = torch.randn(len(lengths), generator=torch.Generator().manual_seed(0)).to(CUDA)

    expected, expected_grads = scores_and_grads(
        padded, weights, plain["input_ids"].to(CUDA), plain["attention_mask"].to(CUDA)
    )
    packed_rows.ATTENTION_PATHS.clear()
    got, grads = scores_and_grads(packed, weights, row["input_ids"].to(CUDA), packed=on_cuda(row))
    seen = packed_rows.ATTENTION_PATHS
    assert seen == {"varlen"}
    assert expected.std() > 0.1  # the scores differ from prompt to prompt: the comparison has teeth
    assert rel(got, expected) < TOL, rel(got, expected)
    assert grads.keys() == expected_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in expected_grads.items():
        assert rel(grads[name], grad) < TOL, (name, rel(grads[name], grad))

    # the same row read as one segment (attention across prompts) is far off: the tolerance would catch a leak
    leaky = on_cuda(row)
    width = row["input_ids"].shape[1]
    leaky.update(cu_seqlens=torch.tensor([0, width], dtype=torch.int32, device=CUDA), bounds=(0, width))
    leaky.update(max_length=width)
    wrong, _ = scores_and_grads(packed, weights, row["input_ids"].to(CUDA), packed=leaky)
    assert rel(wrong, expected) > 5 * TOL
