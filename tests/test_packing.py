"""data.packing: packed rows give the padded batches' logits and per-parameter gradients (fp32), in one pass,
under accumulation, with every loss and distillation; the layout, the bounded shapes, the config's refusals."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_OVERRIDES, compose_config, run_tiny
from test_model import _spread_weights, model_cfg
from test_training import read_csv

from lychee_exp.config.schema import to_run_config
from lychee_exp.data.groups import GroupCollator
from lychee_exp.data.packing import pack, round_up
from lychee_exp.errors import TrainingDiverged, UserError
from lychee_exp.model.packed import block_causal_mask
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.train.losses import RankingLoss
from lychee_exp.train.progress import NO_HOOKS, StepHooks
from lychee_exp.train.step import WindowStep
from lychee_exp.train.trainer import train_on_rank

LORA = ("model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.0")
TEXT = "the lychee fruit grows in warm regions and has a rough red skin with sweet white flesh inside"
WORDS = TEXT.split()


def _groups(count: int, group_size: int = 4, seed: int = 0) -> list:
    """Groups with documents of very different lengths (1 to ~60 words), teacher scores with one NaN."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(count):
        docs = []
        for _ in range(group_size):
            n = int(torch.randint(1, 60, (1,), generator=gen))
            docs.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=gen)))
        scores = torch.randn(group_size, generator=gen).tolist()
        scores[-1] = math.nan
        groups.append(("Judge the document", f"query {g} about lychee", docs, scores))
    return groups


def _pair(tmp_path, *overrides):
    """The same tiny Qwen2 (spread weights) loaded padded and packed."""
    cfg = model_cfg(tmp_path, *overrides)
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    padded = load_reranker(cfg, encoder, 0)
    packed = load_reranker(cfg, encoder, 0, packing=True)
    _spread_weights(padded.backbone)
    packed.load_state_dict(padded.state_dict())
    return encoder, padded, packed


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _assert_same_grads(a: dict, b: dict) -> None:
    """Per parameter, to fp32 summation-order noise: 1e-5 of the parameter's largest gradient."""
    assert a.keys() == b.keys() and a
    for name in a:
        scale = float(a[name].abs().max())
        assert scale > 0, name  # every trainable parameter gets a gradient, so equality is not 0 == 0
        torch.testing.assert_close(b[name], a[name], atol=1e-5 * scale, rtol=1e-4, msg=name)


def test_pack_layout():
    batch = pack([[5, 6, 7], [8], [9, 10]], pad_id=0, multiple=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]  # the rounding pad is a segment too
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 6, 8] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["last_index"].tolist() == [2, 3, 5] and batch["lengths"].tolist() == [3, 1, 2]
    assert batch["max_length"] == 3 and batch["bounds"] == (0, 3, 4, 6, 8)
    exact = pack([[1, 2], [3, 4]], pad_id=0, multiple=4)  # no pad: no extra segment
    assert exact["cu_seqlens"].tolist() == [0, 2, 4] and exact["input_ids"].shape == (1, 4)
    assert [round_up(n, 64) for n in (1, 64, 65, 128)] == [64, 64, 128, 128] and round_up(7, 1) == 7


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32), 3)[0, 0]
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, False, True]]


@pytest.mark.parametrize("overrides", [(), LORA, ("model.attn_implementation=eager",)], ids=["sdpa", "lora", "eager"])
def test_packed_logits_and_gradients_equal_padded(tmp_path, overrides):
    """sdpa: causal attention per segment; eager: one block-diagonal mask over the row."""
    encoder, padded, packed = _pair(tmp_path, *overrides)
    groups = _groups(3)
    plain = GroupCollator(encoder)(groups)
    row = GroupCollator(encoder, pack_multiple=64)(groups)
    assert row["input_ids"].shape[0] == 1 and row["input_ids"].shape[1] % 64 == 0
    assert int(row["lengths"].sum()) == int(plain["attention_mask"].sum())  # the same tokens
    loss = RankingLoss("listwise", 4)
    a = padded(plain["input_ids"], plain["attention_mask"])
    loss(a)[0].sum().backward()
    extra = {k: row[k] for k in ("position_ids", "cu_seqlens", "last_index", "max_length", "bounds")}
    b = packed(row["input_ids"], packed=extra)
    loss(b)[0].sum().backward()
    assert a.shape == b.shape == (12,) and a.std() > 0.1  # the scores differ: parity has teeth
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    _assert_same_grads(_grads(padded), _grads(packed))


@pytest.mark.parametrize(
    "loss_name, distill", [("pointwise", 0.0), ("listwise", 0.0), ("listwise", 0.5), ("pointwise", 0.5)]
)
def test_window_with_accumulation_packed_equals_one_padded_batch(tmp_path, loss_name, distill):
    """Two packed micro-batches (accumulated) against one padded batch of both: same loss sums, token counts
    and per-parameter gradients; the packed window computes fewer slots."""
    encoder, padded, packed = _pair(tmp_path)
    groups = _groups(4, seed=1)
    loss_fn = RankingLoss(loss_name, 4, distill_weight=distill)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def window(model, batches):
        step = WindowStep(model, loss_fn, scaler, "fp32", DistEnv(), forward_chunks=1)
        stats, _, _ = step.accumulate(iter(batches), len(batches), divisor=4)
        return stats, _grads(model), step.shapes

    s_pad, g_pad, _ = window(padded, [GroupCollator(encoder)(groups)])
    collate = GroupCollator(encoder, pack_multiple=64)
    s_pack, g_pack, shapes = window(packed, [collate(groups[:2]), collate(groups[2:])])
    torch.testing.assert_close(s_pack[:4], s_pad[:4], atol=1e-5, rtol=1e-6)  # loss, tokens, queries, distill
    assert s_pack[2] == 4 and (distill == 0) == (s_pack[3] == 0)
    tokens, slots = float(s_pack[1]), float(s_pack[4])
    assert tokens <= slots < tokens + 2 * 64 and slots < float(s_pad[4])  # each row's rounding pad is counted
    assert all(width % 64 == 0 and rows == 1 for rows, width in shapes)
    _assert_same_grads(g_pad, g_pack)


def _segments_attention(q, k, v, cu, scale, enable_gqa):
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = [t[s:e].transpose(0, 1) for t in (q, k, v)]
        out[s:e] = F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale, enable_gqa=enable_gqa).transpose(
            0, 1
        )
    return out


def _kernel_now(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """What torch's varlen_attn documents today: causal within each cu_seqlens segment for window (-1, 0)."""
    assert q.dim() == 3 and window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k
    assert enable_gqa == (q.shape[1] != k.shape[1])
    return _segments_attention(q, k, v, cu_q, scale, enable_gqa)


def _kernel_2_10(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: is_causal, no scale, no GQA (key/value must have the query's heads)."""
    assert is_causal and q.shape == k.shape == v.shape
    return _segments_attention(q, k, v, cu_q, None, False)


@pytest.mark.parametrize("kernel", [_kernel_now, _kernel_2_10], ids=["window-gqa-scale", "is_causal"])
def test_varlen_kernel_path_equals_padded(tmp_path, monkeypatch, kernel):
    """The CUDA branch's tensor plumbing (layout, GQA: 4 query heads on 2 key/value heads, causal, scale) on CPU,
    with reference kernels of both varlen_attn signatures."""
    import torch.nn.attention.varlen as varlen

    from lychee_exp.model import packed as packed_rows

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(packed_rows, "_use_varlen", lambda query: True)
    # the lambda hides the signature: give it the kernel's
    monkeypatch.setattr(varlen.varlen_attn, "__signature__", inspect.signature(kernel), raising=False)
    encoder, padded, packed = _pair(tmp_path)
    groups = _groups(2, seed=2)
    plain = GroupCollator(encoder)(groups)
    row = GroupCollator(encoder, pack_multiple=64)(groups)
    extra = {k: row[k] for k in ("position_ids", "cu_seqlens", "last_index", "max_length", "bounds")}
    a, b = packed(row["input_ids"], packed=extra), padded(plain["input_ids"], plain["attention_mask"])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # one per layer


def test_evaluation_batches_score_as_before_under_packed_attention(tmp_path):
    encoder, padded, packed = _pair(tmp_path)
    batch = GroupCollator(encoder)(_groups(2, seed=3))
    with torch.no_grad():
        torch.testing.assert_close(
            packed(batch["input_ids"], batch["attention_mask"]), padded(batch["input_ids"], batch["attention_mask"])
        )


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model=tiny_lychee", "model.kind=sequence_classification"], "data.packing"),  # not a BERT encoder
        (["model=tiny_lychee", "model.attn_implementation=flash_attention_2"], "model.attn_implementation"),
        (["model=tiny_lychee", "parallel=dp"], "parallel=ddp"),
    ],
)
def test_packing_refusals_name_the_key(tmp_path, overrides, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")) as err:
        to_run_config(compose_config([*overrides, "data.packing=true"], tmp_path))
    assert "\n" not in str(err.value) and "data.packing" in str(err.value)


# ------------------------------------------------------------------------------------------------ whole runs
def _history(run_dir) -> list[tuple[float, float]]:
    rows = read_csv(run_dir / "metrics.csv")
    return [(float(r["train/loss"]), float(r["train/grad_norm"])) for r in rows if r.get("train/loss")]


@pytest.mark.parametrize(
    "extra",
    [(), ("data.batch_size=1", "trainer.grad_accum_steps=2", "data.bucket_by_length=true")],
    ids=["plain", "accumulation-bucketed"],
)
def test_packed_run_trains_like_padded(tmp_path, extra):
    """Same per-step losses and gradient norms (relative 1e-4), same dev metrics, <= 2% of slots padding."""
    common = ("logger=csv", "trainer.save_model=false", "trainer.max_steps=6", *extra)
    # the padded reference pads every micro-batch to its longest pair (no forward chunks, which cut padding too)
    _, padded = run_tiny(tmp_path / "padded", *common, "trainer.forward_chunks=1")
    _, packed = run_tiny(tmp_path / "packed", *common, "data.packing=true", "data.pack_multiple=16")
    a, b = _history(tmp_path / "padded"), _history(tmp_path / "packed")
    assert len(a) == len(b) == 6
    torch.testing.assert_close(
        torch.tensor(b, dtype=torch.float64), torch.tensor(a, dtype=torch.float64), rtol=1e-4, atol=0
    )
    for key in ("ndcg@10", "mrr@10", "initial_ndcg@10"):
        assert packed[key] == pytest.approx(padded[key], abs=1e-6), key
    assert packed["padding_share"] <= 0.02 < padded["padding_share"]
    assert packed["distinct_shapes"] >= 1 and padded["distinct_shapes"] >= 1


def test_rows_average_over_the_log_interval(tmp_path):
    """Read every 3 steps: a row's loss is the mean since the last row, its grad norm the logged step's own."""
    common = ("logger=csv", "trainer.save_model=false", "trainer.max_steps=6", "data.packing=true")
    run_tiny(tmp_path / "every", *common)
    run_tiny(tmp_path / "third", *common, "trainer.log_every=3")
    every, third = _history(tmp_path / "every"), _history(tmp_path / "third")
    assert len(third) == 2
    for row, steps in zip(third, (every[0:3], every[3:6])):
        assert row[0] == pytest.approx(sum(loss for loss, _ in steps) / 3, rel=1e-6)
        assert row[1] == pytest.approx(steps[-1][1], rel=1e-6)


def test_non_finite_loss_stops_the_run_at_the_next_read(tmp_path):
    """The loss is read at log steps only; the first non-finite one is named, the run stops there."""
    cfg = to_run_config(
        compose_config(
            [
                *TINY_OVERRIDES,
                "optimizer.lr=1e30",
                "optimizer.max_grad_norm=0",
                "trainer.max_steps=8",
                "trainer.log_every=4",
            ],
            tmp_path,
        )
    )
    plan = plan_devices("single", 1, cuda_count=0, cpu_threads_per_rank=1)
    done: list[int] = []
    with pytest.raises(TrainingDiverged, match=r"loss is (nan|inf) at step (\d)") as err:
        train_on_rank(cfg, DistEnv(), plan, tmp_path, hooks=StepHooks(after_step=lambda step, model: done.append(step)))
    diverged_at = int(err.value.args[0].split("at step ")[1].split()[0])
    assert 1 < diverged_at <= 4 and done == [1, 2, 3, 4]  # read at step 4, not at the diverged step


@pytest.mark.parametrize("budget", [(), ("data.max_tokens_per_batch=1024",)], ids=["queries", "token-budget"])
def test_packed_run_resumes_where_it_stopped(tmp_path, budget):
    """Stopped mid-epoch at step 3 (checkpoint), resumed: the same rows and final metrics as one whole run."""
    args = [*TINY_OVERRIDES, "data.packing=true", "trainer.max_steps=6", "trainer.save_model=false", "logger=csv"]
    args += budget
    plan = plan_devices("single", 1, cuda_count=0, cpu_threads_per_rank=1)

    def run(name: str, *extra: str, hooks: StepHooks = NO_HOOKS) -> dict:
        cfg = to_run_config(compose_config([*args, *extra], tmp_path / name))
        (tmp_path / name).mkdir(exist_ok=True)
        return train_on_rank(cfg, DistEnv(), plan, tmp_path / name, hooks=hooks)

    whole = run("whole")
    steps: list[int] = []
    stop = StepHooks(after_step=lambda step, model: steps.append(step), stop_requested=lambda: len(steps) == 3)
    cut = run("cut", hooks=stop)
    assert cut["preempted_at_step"] == 3
    resumed = run("cut", "trainer.resume=auto")
    assert resumed["steps"] == 6
    for key in ("train_loss", "ndcg@10", "mrr@10"):
        assert resumed[key] == pytest.approx(whole[key], abs=1e-6), key
    cut_rows, whole_rows = _history(tmp_path / "cut"), _history(tmp_path / "whole")
    assert len(cut_rows) == 6 and sum(cut_rows, ()) == pytest.approx(sum(whole_rows, ()), abs=1e-6)
