"""model.answer_head: the relevance logit from the LM head's yes/no rows equals the full-vocabulary path's (fp32),
with the same per-parameter gradients, padded and packed, LoRA and full fine-tuning, both score modes, a head with
a bias; the full forward's LM head is not run; architectures it was not written for keep the full path."""

from __future__ import annotations

import pytest
import torch
from test_packing import LORA, _assert_same_grads, _grads, _groups, _pair

from lychee_exp.data.groups import GroupCollator
from lychee_exp.model import answer_head
from lychee_exp.model.answer_head import answer_row_logit, full_answer, split_backbone
from lychee_exp.train.losses import RankingLoss

YES, NO = 7, 3


def _head(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    with torch.no_grad():
        head.weight.normal_()
        if bias:
            head.bias.normal_(std=5.0)  # large: a bias left out is far outside the tolerance
    return head


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("no_id", [NO, None], ids=["yes_minus_no", "yes_logit"])
def test_two_rows_equal_the_full_projection_and_its_gradients(bias, no_id):
    head = _head(bias)
    hidden = torch.randn(6, 16, requires_grad=True)
    want = full_answer(head(hidden), YES, no_id)
    grads_want = torch.autograd.grad(want.square().sum(), [hidden, *head.parameters()])
    got = answer_row_logit(hidden, head.weight, head.bias, YES, no_id)
    grads_got = torch.autograd.grad(got.square().sum(), [hidden, *head.parameters()])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_wrong_rows_or_a_missing_bias_would_be_seen():
    """The comparison above has teeth: another row pair or no bias gives another logit."""
    head = _head(True)
    hidden = torch.randn(6, 16)
    want = full_answer(head(hidden), YES, NO)
    for got in (
        answer_row_logit(hidden, head.weight, head.bias, NO, YES),
        answer_row_logit(hidden, head.weight, head.bias, YES + 1, NO),
        answer_row_logit(hidden, head.weight, None, YES, NO),
    ):
        assert not torch.allclose(got, want, atol=1e-3)


def test_bf16_autocast_keeps_fp32_for_the_head():
    head = _head(False).to(torch.bfloat16)
    hidden = torch.randn(6, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = answer_row_logit(hidden, head.weight, None, YES, NO)
    exact = hidden.double() @ (head.weight[YES].double() - head.weight[NO].double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-6)


def _full_path(monkeypatch):
    """Today's path: the causal LM's own forward, its LM head over the whole vocabulary at the kept positions."""
    monkeypatch.setattr(answer_head, "split_backbone", lambda backbone: None)


def _untied_head_with_bias(model) -> None:
    """The LM head replaced by an untied one with a bias (Qwen2's has none): the bias must reach the logit."""
    base = model.backbone.get_base_model() if hasattr(model.backbone, "get_base_model") else model.backbone
    old = base.get_output_embeddings()
    torch.manual_seed(3)
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn_like(head.weight) * 0.15)
        head.bias.copy_(torch.randn_like(head.bias))
    base.lm_head = head


@pytest.mark.parametrize(
    "overrides, score, biased",
    [((), "yes_minus_no", False), (LORA, "yes_minus_no", False), ((), "yes_logit", False), ((), "yes_minus_no", True)],
    ids=["full", "lora", "yes_logit", "untied_bias"],
)
def test_reranker_logits_and_gradients_equal_the_full_vocabulary_path(tmp_path, monkeypatch, overrides, score, biased):
    """Padded (two chunks: each row's own last position) and packed batches of the tiny Qwen2: the two-row path
    against the full path per logit and per trainable parameter's gradient; the LM head module never runs."""
    encoder, padded, packed = _pair(tmp_path, *overrides, f"model.score={score}")
    if biased:
        _untied_head_with_bias(padded)
        _untied_head_with_bias(packed)
    groups = _groups(3)
    plain = GroupCollator(encoder)(groups)
    row = GroupCollator(encoder, pack_multiple=64)(groups)
    extra = {k: row[k] for k in ("position_ids", "cu_seqlens", "last_index", "max_length", "bounds")}
    chunks = [([0, 2, 4, 6, 8, 10], plain["input_ids"].shape[1]), ([1, 3, 5, 7, 9, 11], plain["input_ids"].shape[1])]
    loss = RankingLoss("pointwise", 4)  # not listwise: its gradients sum to 0 per group, so the bias gets ~0

    def run(model, **kwargs):
        model.zero_grad(set_to_none=True)
        if "packed" in kwargs:
            logits = model(row["input_ids"], **kwargs)
        else:
            logits = model(plain["input_ids"], plain["attention_mask"], **kwargs)
        loss(logits)[0].sum().backward()
        return logits.detach(), _grads(model)

    head_calls = []
    for model in (padded, packed):
        base = model.backbone.get_base_model() if hasattr(model.backbone, "get_base_model") else model.backbone
        base.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))
    two_rows = [run(padded), run(padded, chunks=chunks), run(packed, packed=extra)]
    assert head_calls == []
    _full_path(monkeypatch)
    full = [run(padded), run(padded, chunks=chunks), run(packed, packed=extra)]
    assert len(head_calls) == 4  # the full path does run it: the hook would have seen the two-row path
    for (got, got_grads), (want, want_grads) in zip(two_rows, full):
        assert got.shape == (12,) and want.std() > 0.1
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
        _assert_same_grads(want_grads, got_grads)


def test_heads_it_was_not_written_for_keep_the_full_path(tmp_path):
    """Soft-capped logits, a head that is not a plain Linear (LoRA on lm_head), a sharded (DTensor) weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    encoder, padded, _ = _pair(tmp_path)
    backbone = padded.backbone
    assert split_backbone(backbone) is not None
    backbone.config.model_type = "gemma2"  # its forward is not lm_head(decoder(...))
    assert split_backbone(backbone) is None
    backbone.config.model_type = "qwen2"
    plain = backbone.lm_head
    backbone.lm_head = type("WrappedLinear", (torch.nn.Linear,), {})(plain.in_features, plain.out_features, bias=False)
    assert split_backbone(backbone) is None
    backbone.lm_head = plain
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain.weight = torch.nn.Parameter(distribute_tensor(plain.weight.detach(), mesh, [Shard(0)]))
        assert split_backbone(backbone) is None
    finally:
        torch.distributed.destroy_process_group()


def test_bench_counts_the_full_logits_and_not_the_weight():
    """benchmarks/yes_no_head.py's peak: the full path holds at least its (rows, vocab) logits, the two-row path a
    small fraction of them (the weight and hidden states, which exist before the step, are not counted)."""
    from benchmarks.yes_no_head import measure, shapes

    hidden, vocab = shapes()["tiny"]
    got = measure((hidden, vocab), "fp32", False, rows=4, repeats=1)
    logits_mib = 4 * vocab * 4 / 2**20
    assert got["full"]["peak_mb"] >= logits_mib
    assert got["two_rows"]["peak_mb"] < 0.05 * logits_mib
    assert got["full"]["ms"] > 0 and got["two_rows"]["ms"] > 0
