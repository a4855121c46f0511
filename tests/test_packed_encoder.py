"""Packed rows through the BERT-family cross-encoder (model.packed_encoder) and their attention prompt by prompt
(model.packed, float32 where gradients flow on CPU in bf16): the padded batch's logits and per-parameter
gradients, the token types of each prompt, and where data.packing=auto packs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config, run_job
from test_packing import _grads, _groups
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lychee_exp.config.auto import packing_on
from lychee_exp.config.schema import to_run_config
from lychee_exp.data import packing
from lychee_exp.data.groups import GroupCollator
from lychee_exp.data.pair_prompt import token_types
from lychee_exp.errors import UserError
from lychee_exp.model import packed as packed_rows
from lychee_exp.model.packed import float32_for_backward, packed_token_types, per_prompt_attention
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer
from lychee_exp.train.losses import RankingLoss

MINILM = ["model=minilm_cross_encoder", "model.dropout=0.0"]
PACKED_KEYS = ("position_ids", "cu_seqlens", "last_index", "max_length", "bounds")


@pytest.fixture(scope="module")
def minilm_pair(tmp_path_factory):
    """MiniLM loaded padded and packed with the same weights; the new classifier spread so that scores differ."""
    cfg = to_run_config(compose_config(MINILM, tmp_path_factory.mktemp("run"))).model
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    padded = load_reranker(cfg, encoder, 0, training=True)
    with torch.no_grad():
        padded.backbone.classifier.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    packed = load_reranker(cfg, encoder, 0, packing=True, training=True)
    packed.load_state_dict(padded.state_dict())
    return encoder, padded, packed


def _both(encoder, padded, packed, groups):
    plain = GroupCollator(encoder)(groups)
    row = GroupCollator(encoder, pack_multiple=64)(groups)
    assert int(row["lengths"].sum()) == int(plain["attention_mask"].sum())  # the same tokens
    return (lambda: padded(plain["input_ids"], plain["attention_mask"])), (
        lambda: packed(row["input_ids"], packed={k: row[k] for k in PACKED_KEYS})
    )


def test_packed_minilm_logits_and_gradients_equal_padded(minilm_pair):
    encoder, padded, packed = minilm_pair
    run_padded, run_packed = _both(encoder, padded, packed, _groups(3))
    for model in (padded, packed):
        model.zero_grad(set_to_none=True)
    loss = RankingLoss("listwise", 4)
    a, b = run_padded(), run_packed()
    loss(a)[0].sum().backward()
    loss(b)[0].sum().backward()
    assert a.shape == b.shape == (12,) and a.std() > 0.05  # the scores differ: parity has teeth
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert_gradients_match(_grads(packed), _grads(padded))


def assert_gradients_match(ours: dict, reference: dict) -> None:
    """Every parameter's gradient to 1e-5 of the model's largest gradient: a few parameters' true gradient is 0
    (softmax ignores a bias added to every key, and the listwise loss one added to every score), and there both
    sides are rounding noise."""
    largest = max(float(g.abs().max()) for g in reference.values())
    assert ours.keys() == reference.keys() and largest > 0
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], atol=1e-5 * largest, rtol=1e-4, msg=name)


def test_packed_minilm_in_bf16_attends_per_prompt_and_stays_close(minilm_pair):
    encoder, padded, packed = minilm_pair
    run_padded, run_packed = _both(encoder, padded, packed, _groups(3, seed=2))
    packed_rows.ATTENTION_PATHS.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = run_padded(), run_packed()
    assert {"sdpa_per_prompt"} == packed_rows.ATTENTION_PATHS  # (the padded model records nothing)
    with torch.no_grad():
        truth = run_padded()  # fp32
    # bf16 rounding, not a different model: the packed bf16 logits are about as far from the fp32 ones as the
    # padded bf16 logits are (whose error depends on the CPU's bf16 kernels: AVX-512 BF16, AMX), and far closer
    # than the logits are to each other
    padded_error, packed_error = float((a - truth).abs().max()), float((b - truth).abs().max())
    assert packed_error <= 2 * padded_error + 2**-7 * float(truth.abs().max())
    assert packed_error < 0.25 * float(truth.std())


def test_packed_token_types_restart_at_each_prompt(minilm_pair):
    encoder = minilm_pair[0]
    ids = encoder.encode_many([("Judge", "q one", "doc a b"), ("Judge", "a longer query", "d")])
    row = packing.pack(ids, encoder.pad_id, 16)
    got = packed_token_types(row["input_ids"], row["cu_seqlens"], encoder.sep_id)[0].tolist()
    want = []
    for seq in ids:
        t = torch.tensor([seq])
        want += token_types(t, torch.ones_like(t), encoder.sep_id)[0].tolist()
    assert got[: len(want)] == want and 1 in want and want.count(0) > 2


def _reference(q, k, v, bounds, causal, scale):
    """sdpa on each segment in turn, (1, width, heads, dim)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    parts = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=causal, scale=scale)
        for s, e in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)


def _module(causal: bool, heads: int, kv_heads: int) -> SimpleNamespace:
    """What transformers' sdpa reads of an attention module."""
    return SimpleNamespace(is_causal=causal, num_key_value_groups=heads // kv_heads, training=False)


@pytest.mark.parametrize("causal, kv_heads", [(False, 4), (True, 4), (True, 2)], ids=["both-ways", "causal", "gqa"])
def test_per_prompt_attention_equals_sdpa_per_segment_forward_and_backward(causal, kv_heads):
    gen = torch.Generator().manual_seed(0)
    bounds = (0, 5, 6, 19, 30, 32)  # uneven segments, one of a single token
    q = torch.randn(1, 4, 32, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, 32, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv")
    grad = torch.randn(1, 32, 4, 8, dtype=torch.float64, generator=gen)
    got = per_prompt_attention(sdpa_attention_forward, _module(causal, 4, kv_heads), q, k, v, bounds, 0.3, 0.0)
    (g_q, g_k, g_v) = torch.autograd.grad(got, (q, k, v), grad)
    want = _reference(q, k, v, bounds, causal, 0.3)
    (w_q, w_k, w_v) = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in ((got, want), (g_q, w_q), (g_k, w_k), (g_v, w_v)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_bf16_attention_that_trains_computes_in_float32_on_cpu():
    """Under bf16 autocast on CPU, a training step's attention is float32's, cast back (forward and gradients
    bit for bit), while scoring without gradients stays in bf16."""
    gen = torch.Generator().manual_seed(1)
    bounds = (0, 7, 20, 24)
    q, k, v = (torch.randn(1, 4, 24, 8, generator=gen).bfloat16().requires_grad_() for _ in "qkv")
    grad = torch.randn(1, 24, 4, 8, generator=gen).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = per_prompt_attention(sdpa_attention_forward, _module(False, 4, 4), q, k, v, bounds, None, 0.0)
    assert got.dtype == torch.bfloat16
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    up = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = _reference(*up, bounds, False, None).bfloat16()
    want_grads = [g.bfloat16() for g in torch.autograd.grad(want, up, grad)]
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
    assert float32_for_backward(q) and not float32_for_backward(q.float())
    with torch.no_grad():
        assert not float32_for_backward(q)  # scoring: bf16's forward is the faster one
        scored = per_prompt_attention(sdpa_attention_forward, _module(False, 4, 4), q, k, v, bounds, None, 0.0)
    assert torch.equal(scored, _reference(q.detach(), k.detach(), v.detach(), bounds, False, None))


@pytest.mark.parametrize(
    "overrides, device, strategy, packs",
    [
        (MINILM, "cpu", "single", True),
        (MINILM, "cpu", "ddp", True),
        (MINILM, "cuda", "ddp", False),
        (MINILM, "cpu", "dp", False),
        ([*MINILM, "data.packing=false"], "cpu", "single", False),
        (["model=tiny_lychee"], "cpu", "single", False),  # causal LMs pad unless asked
        (["model=tiny_lychee", "data.packing=true"], "cpu", "single", True),
    ],
)
def test_auto_packs_encoder_cross_encoders_on_cpu(tmp_path, overrides, device, strategy, packs):
    assert packing_on(to_run_config(compose_config(overrides, tmp_path)), device, strategy) is packs


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.packing=sometimes", "data.packing must be true, false or auto, got 'sometimes'"),
        ("model.kind=sequence_classification", "packs BERT-family encoders only"),
    ],
)
def test_packing_setting_mistakes_are_one_line(tmp_path, override, message):
    with pytest.raises(UserError, match=message) as err:
        to_run_config(compose_config(["model=tiny_lychee", "data.packing=true", override], tmp_path))
    assert "\n" not in str(err.value)


def test_the_minilm_default_trains_packed(tmp_path):
    """The CPU default (data.packing=auto): packed rows, a few percent of slots padding (each row's rounding)."""
    common = [*MINILM, "data=sample", "trainer.max_steps=2", "trainer.evaluate=false", "trainer.save_model=false"]
    _, metrics = run_job([*common, "logger=none", "trainer.measure_speedup=false"], tmp_path / "auto")
    _, padded = run_job([*common, "logger=none", "trainer.measure_speedup=false", "data.packing=false",
                      "trainer.forward_chunks=1"], tmp_path / "padded")  # fmt: skip
    assert metrics["padding_share"] < 0.05 < padded["padding_share"]


def test_the_own_batching_meter_counts_packed_rows(minilm_pair):
    """benchmarks.own_batching meters what each model reads; packed rows skip the classifier class's forward, so the
    encoder's packed calls are metered: every prompt and real token, not the rounding pad."""
    from benchmarks.own_batching_loops import Meter, _encoder_class

    encoder, padded, packed = minilm_pair
    meter = Meter()
    undo = meter.wrap_packed(_encoder_class(type(packed.backbone)))
    try:
        run_padded, run_packed = _both(encoder, padded, packed, _groups(3))
        with torch.no_grad():
            run_padded()  # not a packed call: not counted here
            run_packed()
        meter.stamp()
    finally:
        undo()
    row = GroupCollator(encoder, pack_multiple=64)(_groups(3))
    assert row["input_ids"].shape[1] > int(row["lengths"].sum())  # a rounding pad to leave out
    assert [(int(t), slots, int(n)) for t, slots, n in meter.calls] == [
        (int(row["lengths"].sum()), row["input_ids"].shape[1], 12)
    ]
