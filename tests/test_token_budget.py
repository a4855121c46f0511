"""data.max_tokens_per_batch: micro-batches of whole query groups within a token budget. The plan (whole groups,
within the budget, the same on every rank, padded with empty micro-batches), one packed shape per run, the loss
as the mean over every query of the global step on ranks holding different numbers of queries (per-parameter
gradients against one process on the union of the ranks' micro-batches), the LR scaling figure, one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TINY_OVERRIDES, TINY_RANKS, compose_config, run_tiny
from equivalence import assert_same_training
from gradient_helpers import spawned_gradients, trainer_for, window_gradients
from test_training import read_csv

from lychee_exp.config.auto import scaled_lr
from lychee_exp.config.schema import to_run_config
from lychee_exp.data.budget import plan_epoch
from lychee_exp.errors import UserError
from lychee_exp.job.in_process import run_job

BUDGET = ("data.max_tokens_per_batch=2048", "data.packing=true")


def _sizes(count: int, seed: int = 0) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    widths = torch.randint(10, 200, (count,), generator=gen).tolist()
    return [(4 * w - int(torch.randint(0, w, (1,), generator=gen)), w) for w in widths]  # (tokens, longest)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("pool", [0, 3], ids=["shuffled", "bucketed"])
def test_plan_takes_whole_groups_within_the_budget(packing, pool):
    sizes, budget, group = _sizes(200), 2000, 4
    plan = plan_epoch(sizes, budget, packing, group, seed=3, epoch=1, pool=pool)
    assert sorted(i for b in plan for i in b) == list(range(200))  # every group once, whole
    for batch in plan:
        cost = sum(sizes[i][0] for i in batch) if packing else len(batch) * group * max(sizes[i][1] for i in batch)
        assert 0 < cost <= budget
    # greedy: a batch ends only when its next group would not fit (shuffled order: the next batch's first)
    if not pool and packing:
        for batch, after in zip(plan, plan[1:]):
            assert sum(sizes[i][0] for i in batch) + sizes[after[0]][0] > budget
    assert len({len(b) for b in plan}) > 1  # the number of queries per micro-batch varies
    assert plan == plan_epoch(sizes, budget, packing, group, seed=3, epoch=1, pool=pool)  # a function of the seed
    assert plan != plan_epoch(sizes, budget, packing, group, seed=3, epoch=2, pool=pool)


def test_group_over_the_budget_is_one_line_naming_the_key():
    with pytest.raises(UserError, match=r"data\.max_tokens_per_batch=500 .* needs 780 tokens") as err:
        plan_epoch([(100, 30), (780, 200)], 500, True, 4, 0, 0, 0)
    assert "\n" not in str(err.value) and ">= 780" in str(err.value)
    with pytest.raises(UserError, match=r"4 rows x 200"):  # padded: rows x the group's longest prompt
        plan_epoch([(100, 30), (780, 200)], 500, False, 4, 0, 0, 0)


@pytest.mark.parametrize(
    "override, key",
    [("data.max_tokens_per_batch=0", "data.max_tokens_per_batch"), ("parallel=dp", "parallel=ddp")],
)
def test_config_errors_are_one_line(tmp_path, override, key):
    overrides = ["model=tiny_lychee", "data.max_tokens_per_batch=4096", override]
    with pytest.raises(UserError, match=key.replace(".", r"\.")) as err:
        to_run_config(compose_config(overrides, tmp_path))
    assert "\n" not in str(err.value)


def test_preflight_refuses_a_budget_smaller_than_a_group(tmp_path):
    """Before any process starts: the CLI ends with the one line, no traceback."""
    from conftest import output_lines, run_cli

    proc = run_cli([*TINY_OVERRIDES, *BUDGET[1:], "data.max_tokens_per_batch=64"], tmp_path / "run")
    lines = output_lines(proc)
    assert proc.returncode != 0 and not any("Traceback" in line for line in lines)
    assert any("data.max_tokens_per_batch=64 cannot hold one query group" in line for line in lines), lines


def test_every_packed_row_is_the_budget_wide_and_padded_rows_stay_within_it(tmp_path):
    packed = trainer_for(tmp_path / "packed", *BUDGET)
    padded = trainer_for(tmp_path / "padded", "data.max_tokens_per_batch=3072", "trainer.forward_chunks=1")
    for trainer in (packed, padded):
        trainer.data.schedule.seek(0, 0)
        batches = list(trainer.data.loader)
        assert len(batches) == trainer.data.schedule.num_batches(0) > 2
        if trainer is packed:
            assert {tuple(b["input_ids"].shape) for b in batches} == {(1, 2048)}
            assert all(int(b["lengths"].sum()) <= 2048 for b in batches)
        else:
            assert all(b["input_ids"].numel() <= 3072 for b in batches)
        queries = [b["input_ids"].shape[0] if trainer is padded else len(b["lengths"]) for b in batches]
        assert sum(queries) // 4 == len(trainer.data.train_set)  # every query once per epoch


def test_lr_scales_with_the_plans_mean_batch(tmp_path):
    trainer = trainer_for(tmp_path, *BUDGET, "optimizer.lr_scaling=linear", "optimizer.base_batch_size=2")
    plan = trainer.data.schedule.plan(0)
    mean = sum(len(b) for b in plan) / math.ceil(len(plan) / trainer.cfg.trainer.grad_accum_steps)
    assert trainer.facts["effective_batch_size"] == pytest.approx(mean)
    assert mean != trainer.cfg.data.batch_size  # not the configured per-device batch
    assert trainer.lr == pytest.approx(trainer.cfg.optimizer.lr * mean / 2)
    assert scaled_lr(trainer.cfg, 1, mean) == pytest.approx(trainer.lr)


def test_packed_budget_run_has_one_shape_and_logs_queries_and_tokens(tmp_path):
    _, metrics = run_tiny(tmp_path, *BUDGET, "logger=csv", "trainer.max_steps=6", "data.max_train_queries=16")
    assert metrics["distinct_shapes"] == 1
    rows = [r for r in read_csv(tmp_path / "metrics.csv") if r.get("train/loss")]
    queries = [float(r["train/queries_per_step"]) for r in rows]
    tokens = [float(r["train/tokens_per_step"]) for r in rows]
    assert len(rows) == 6 and len(set(queries)) > 1 and all(0 < t <= 2048 for t in tokens)


# ------------------------------------------------------------------------------------------ two gloo ranks
UNEVEN = [*BUDGET, "data.max_train_queries=17", "data.bucket_by_length=true", "data.bucket_pool_batches=2"]


@pytest.mark.slow
def test_two_ranks_give_the_gradient_of_one_process_on_their_union(tmp_path):
    """Rank 0 and rank 1 hold different query counts, and in the last window rank 1 has no share left (its
    dummy batch weighs 0); DDP's averaged gradient must equal one process's over both ranks' micro-batches
    (accumulation 2), per parameter. Dividing by each rank's own count (the mean of rank means) must not."""
    single = trainer_for(tmp_path / "single", *UNEVEN, "trainer.grad_accum_steps=2")
    plan = single.data.schedule.plan(0)
    assert len(plan) % 2 == 1  # the last window has one micro-batch: rank 1's share ends first
    uneven = next(w for w in range(len(plan) // 2) if len(plan[2 * w]) != len(plan[2 * w + 1]))  # 4 vs 3 queries
    want = window_gradients(single)
    got = spawned_gradients(tmp_path, UNEVEN)
    assert len(want) == len(got[0]) == len(got[1]) == (len(plan) + 1) // 2
    for window, reference in enumerate(want):
        ddp = got[0][window]
        assert all(torch.equal(ddp[k], got[1][window][k]) for k in ddp)  # DDP: every rank has the average
        for name, grad in reference.items():
            scale = float(grad.abs().max())
            assert scale > 0, name
            torch.testing.assert_close(ddp[name], grad, atol=1e-5 * scale, rtol=1e-4, msg=name)
    # the mean of the ranks' own means (each rank dividing by its own query count) differs: the check has teeth
    sums = []
    for first in (2 * uneven, 2 * uneven + 1):  # that window's two micro-batches one at a time, losses summed
        single.data.schedule.seek(0, first)
        single.step.accumulate(iter(single.data.loader), 1, 1.0)
        sums.append({k: p.grad.clone() for k, p in single.model.named_parameters() if p.requires_grad})
        single.model.zero_grad(set_to_none=True)
    counts = len(plan[2 * uneven]), len(plan[2 * uneven + 1])
    name = next(iter(want[0]))
    union = (sums[0][name] + sums[1][name]) / sum(counts)
    torch.testing.assert_close(union, want[uneven][name], atol=1e-6, rtol=1e-4)
    mean_of_means = (sums[0][name] / counts[0] + sums[1][name] / counts[1]) / 2
    assert not torch.allclose(mean_of_means, got[0][uneven][name], rtol=1e-3, atol=0)


@pytest.mark.slow
def test_ddp_budget_run_matches_one_process(tmp_path):
    """Whole runs at trainer.global_tokens_per_step = 2 budgets (what a sweep slot of 1 or 2 devices gets): 2
    ranks (accumulation 1) against one process (accumulation 2) on the same plan: every step's loss (1e-5
    relative), pre-clip gradient norm and the saved weights."""
    common = [*TINY_RANKS, *UNEVEN, "trainer.measure_speedup=false", "trainer.max_steps=5", "optimizer.lr=1e-3"]
    common += ["trainer.global_tokens_per_step=4096"]
    run_job([*common, "parallel=single", "gpus=1"], tmp_path / "single")
    run_job([*common, "parallel=ddp", "gpus=2"], tmp_path / "ddp")
    assert_same_training(tmp_path / "ddp", tmp_path / "single", rtol=1e-5)
    # epoch 0's last step (step 3) had rank 1 on a dummy batch, and the run went on into epoch 1 without a hang
    m = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert m["steps"] == 5 and m["num_devices"] == 2 and m["distinct_shapes"] == 1 and m["grad_accum_steps"] == 1
    assert json.loads((tmp_path / "single" / "metrics.json").read_text())["grad_accum_steps"] == 2


def test_checkpointing_auto_decides_from_the_budget(tmp_path, monkeypatch):
    """On CUDA, auto estimates the budget's slots, not rows x the widest prompt: with free memory between the two
    estimates the budget runs without checkpointing and the fixed batch with it."""
    import re

    from lychee_exp.parallel.memory_plan import resolve_checkpointing
    from lychee_exp.train.inputs import load_inputs

    common = ["model.gradient_checkpointing=auto", "model.dtype=bfloat16", "model.prompt.max_len=2048"]
    fixed = to_run_config(compose_config([*TINY_RANKS, *common, "data.batch_size=8"], tmp_path / "fixed"))
    budget = to_run_config(compose_config([*TINY_RANKS, *common, "data.max_tokens_per_batch=1024"], tmp_path / "b"))
    encoder = load_inputs(fixed).encoder
    cuda = torch.device("cuda", 0)

    def decide(cfg, free: float):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free + 1))
        return resolve_checkpointing(cfg, encoder, cuda)

    need = {}
    for name, cfg in (("fixed", fixed), ("budget", budget)):
        _, why = decide(cfg, 2**50)
        need[name] = float(re.search(r"([\d.]+) GiB estimated", why).group(1)) * 2**30
        slots = int(re.search(r"\((\d+) token slots\)", why).group(1))
        assert slots == (1024 if name == "budget" else 8 * 4 * 2048), why
    middle = (need["fixed"] + need["budget"]) / 2
    assert need["budget"] < middle < need["fixed"]
    assert decide(budget, middle)[0] is False and decide(fixed, middle)[0] is True
