"""Training runs of the tiny model: losses fall, metrics.json, determinism, accumulation, lr scaling."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_OVERRIDES, compose_config, run_tiny
from faults import fault_hook
from transformers import AutoModelForCausalLM, AutoTokenizer

from lychee_exp.config.auto import effective_batch_size, scaled_lr
from lychee_exp.config.schema import to_run_config
from lychee_exp.train import losses

REQUIRED_KEYS = {
    "ndcg@10",
    "mrr@10",
    "initial_ndcg@10",
    "initial_mrr@10",
    "bm25_ndcg@10",
    "bm25_mrr@10",
    "train_loss",
    "steps",
    "effective_batch_size",
    "lr",
    "train_samples_per_s",
    "train_time_s",
}


def read_csv(path: Path) -> list[dict]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def train_losses(run_dir: Path) -> list[float]:
    return [float(row["train/loss"]) for row in read_csv(run_dir / "metrics.csv") if row.get("train/loss")]


# ------------------------------------------------------------------------------------------------ loss units
def test_pointwise_matches_hand_computation():
    logits = torch.tensor([2.0, -1.0, 0.5, -0.3, 0.7, 1.5])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [
        (-math.log(sig(2.0)) - math.log(1 - sig(-1.0)) - math.log(1 - sig(0.5))) / 3,
        (-math.log(sig(-0.3)) - math.log(1 - sig(0.7)) - math.log(1 - sig(1.5))) / 3,
    ]
    got = losses.pointwise(logits, group_size=3)
    assert got.shape == (2,)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_pointwise_is_yes_no_softmax_cross_entropy():
    """logit = logit(yes) - logit(no): BCE on it equals the 2-way softmax cross-entropy over (yes, no)."""
    yes_no = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1])  # index 0 = yes for each group's first (positive) pair
    reference = F.cross_entropy(yes_no, target, reduction="none").view(2, 4).mean(1)
    torch.testing.assert_close(losses.pointwise(yes_no[:, 0] - yes_no[:, 1], 4), reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_listwise_matches_hand_computation(temperature):
    logits = torch.tensor([2.0, -1.0, 0.5, -0.3, 0.7, 1.5])
    expected = []
    for group in ([2.0, -1.0, 0.5], [-0.3, 0.7, 1.5]):
        z = [g / temperature for g in group]
        expected.append(-(z[0] - math.log(sum(math.exp(v) for v in z))))
    got = losses.listwise(logits, group_size=3, temperature=temperature)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_losses_have_gradients_toward_the_positive():
    for fn in (losses.pointwise, losses.listwise):
        logits = torch.zeros(4, requires_grad=True)
        fn(logits, 4).sum().backward()
        assert logits.grad[0] < 0 and (logits.grad[1:] > 0).all(), fn.__name__


# ------------------------------------------------------------------------------------------------ lr scaling
@pytest.mark.parametrize(("scaling", "factor"), [("none", 1.0), ("linear", 8.0), ("sqrt", math.sqrt(8.0))])
def test_scaled_lr(scaling, factor, tmp_path):
    cfg = to_run_config(
        compose_config(
            [
                "model=tiny_lychee",
                "loss=pointwise",
                "optimizer.lr=1e-3",
                "optimizer.base_batch_size=4",
                f"optimizer.lr_scaling={scaling}",
                "data.batch_size=8",
                "trainer.grad_accum_steps=2",
            ],
            tmp_path,
        )
    )
    assert effective_batch_size(cfg, 2) == 32
    assert scaled_lr(cfg, 2) == pytest.approx(1e-3 * factor)
    # at the base batch size every rule leaves lr alone
    cfg.data.batch_size, cfg.trainer.grad_accum_steps = 4, 1
    assert scaled_lr(cfg, 1) == pytest.approx(1e-3)


# ------------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def standard_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("standard_run")
    value, metrics = run_tiny(
        out, "logger=csv", "optimizer.lr_scaling=linear", "optimizer.base_batch_size=4", "optimized_metric=mrr@10"
    )
    return out, value, metrics


def test_run_writes_metrics_json(standard_run):
    out, value, metrics = standard_run
    assert set(metrics) >= REQUIRED_KEYS, REQUIRED_KEYS - set(metrics)
    for key in REQUIRED_KEYS:
        assert isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]), key
    for key in ("ndcg@10", "mrr@10", "initial_ndcg@10", "initial_mrr@10", "bm25_ndcg@10", "bm25_mrr@10"):
        assert 0.0 <= metrics[key] <= 1.0, key
    assert metrics["steps"] == 4
    assert metrics["effective_batch_size"] == 2
    assert metrics["lr"] == pytest.approx(1e-3 * 2 / 4)  # linear scaling from base batch 4 to 2
    assert metrics["train_samples_per_s"] > 0 and metrics["train_time_s"] > 0
    assert (out / "config.yaml").is_file()


def test_run_returns_optimized_metric(standard_run):
    out, value, metrics = standard_run
    assert metrics["optimized_metric"] == "mrr@10"
    assert value == pytest.approx(metrics["mrr@10"])


def test_csv_logger_rows(standard_run):
    out, _, metrics = standard_run
    rows = read_csv(out / "metrics.csv")
    steps_with_loss = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert steps_with_loss == [1, 2, 3, 4]  # log_every=1
    assert float([r for r in rows if r.get("train/loss")][-1]["train/loss"]) == pytest.approx(metrics["train_loss"])
    dev_rows = [r for r in rows if r.get("dev/ndcg@10")]
    assert int(dev_rows[0]["step"]) == 0 and int(dev_rows[-1]["step"]) == 4
    assert float(dev_rows[-1]["dev/ndcg@10"]) == pytest.approx(metrics["ndcg@10"])
    assert float(dev_rows[0]["dev/ndcg@10"]) == pytest.approx(metrics["initial_ndcg@10"])


def test_saved_model_loads_with_transformers(standard_run):
    out, _, _ = standard_run
    model = AutoModelForCausalLM.from_pretrained(str(out / "model"))
    tokenizer = AutoTokenizer.from_pretrained(str(out / "model"))
    assert model.config.model_type == "qwen2"
    assert len(tokenizer("yes", add_special_tokens=False)["input_ids"]) == 1


def test_run_with_model_from_previous_run_reproduces_its_final_metrics(standard_run, tmp_path):
    """The saved model directory is a valid model.path: evaluating it before training gives the final metrics."""
    out, _, metrics = standard_run
    _, again = run_tiny(tmp_path, f"model.path={out / 'model'}", "model.random_init=false", "trainer.save_model=false")
    assert again["initial_ndcg@10"] == pytest.approx(metrics["ndcg@10"], abs=1e-6)


@pytest.mark.parametrize("loss", ["pointwise", "listwise"])
def test_loss_falls(loss, tmp_path):
    _, metrics = run_tiny(
        tmp_path,
        f"loss={loss}",
        "logger=csv",
        "data.max_train_queries=16",
        "data.batch_size=4",
        "data.max_dev_queries=2",
        "trainer.max_steps=60",
        "trainer.log_every=1",
        "optimizer.lr=2e-3",
        "optimizer.warmup_ratio=0.05",
        "trainer.save_model=false",
    )
    series = train_losses(tmp_path)
    assert len(series) == 60
    first, last = sum(series[:8]) / 8, sum(series[-8:]) / 8
    print(f"{loss}: first {first:.4f} last {last:.4f}")
    assert last < first * 0.8, (first, last)
    assert metrics["epochs"] >= 10  # 16 queries / batch 4 = 4 steps per epoch: the data repeats


def test_max_steps_overrides_epochs(tmp_path):
    _, metrics = run_tiny(tmp_path / "a", "trainer.max_epochs=5", "trainer.max_steps=3", "trainer.save_model=false")
    assert metrics["steps"] == 3


def test_epochs_when_no_max_steps(tmp_path):
    # 8 queries, batch 2 -> 4 steps per epoch
    _, metrics = run_tiny(tmp_path, "trainer.max_epochs=2", "trainer.max_steps=-1", "trainer.save_model=false")
    assert metrics["steps"] == 8 and metrics["epochs"] == 2


def test_seeded_runs_are_identical(tmp_path):
    extra = ("trainer.deterministic=true", "trainer.save_model=false")
    _, a = run_tiny(tmp_path / "a", *extra)
    _, b = run_tiny(tmp_path / "b", *extra)
    assert a["ndcg@10"] == b["ndcg@10"]
    assert a["mrr@10"] == b["mrr@10"]
    assert a["train_loss"] == b["train_loss"]
    _, c = run_tiny(tmp_path / "c", *extra, "seed=7")
    assert c["train_loss"] != a["train_loss"]


def test_gradient_accumulation_matches_big_batch(tmp_path):
    common = (
        "trainer.deterministic=true",
        "trainer.precision=fp32",
        "trainer.save_model=false",
        "logger=csv",
        "trainer.max_steps=6",
        "optimizer.lr_scaling=none",
    )
    _, big = run_tiny(tmp_path / "big", "data.batch_size=4", "trainer.grad_accum_steps=1", *common)
    _, acc = run_tiny(tmp_path / "acc", "data.batch_size=2", "trainer.grad_accum_steps=2", *common)
    assert big["effective_batch_size"] == acc["effective_batch_size"] == 4
    assert big["steps"] == acc["steps"] == 6
    torch.testing.assert_close(
        torch.tensor(train_losses(tmp_path / "acc"), dtype=torch.float64),
        torch.tensor(train_losses(tmp_path / "big"), dtype=torch.float64),
        atol=1e-5,
        rtol=0,
    )
    assert acc["train_loss"] == pytest.approx(big["train_loss"], abs=1e-5)
    assert acc["ndcg@10"] == pytest.approx(big["ndcg@10"], abs=1e-5)
    assert acc["mrr@10"] == pytest.approx(big["mrr@10"], abs=1e-5)


def test_a_failed_run_leaves_the_earlier_metrics_json_as_it_was(tmp_path):
    """A run that fails (here its checks) writes no metrics.json and deletes none: the one in its directory is the
    earlier attempt's, which a continued run keeps until it writes its own (issue 51: a resume that failed a check
    used to leave the run without it). A sweeper never meets it: every trial gets a directory no earlier trial
    used (tests/test_escape_hatches.py)."""
    from lychee_exp.errors import UserError
    from lychee_exp.job.training_job import train_job as run

    (tmp_path / "metrics.json").write_text('{"ndcg@10": 99}')
    cfg = compose_config(
        [
            *TINY_OVERRIDES,
            "data=jsonl",
            f"data.train_file={tmp_path / 'missing.jsonl'}",
            f"data.dev_file={tmp_path / 'missing.jsonl'}",
        ],
        tmp_path,
    )
    with pytest.raises(UserError, match="missing.jsonl"):
        run(cfg)
    assert (tmp_path / "metrics.json").read_text() == '{"ndcg@10": 99}'


def test_inputs_are_read_once_per_process(tmp_path):
    """preflight reads the data files and builds the tokenizer; the in-process Trainer reuses them."""
    import lychee_exp.train.inputs as inputs

    with (
        mock.patch.object(inputs, "load_queries", wraps=inputs.load_queries) as load_queries,
        mock.patch.object(inputs, "load_tokenizer", wraps=inputs.load_tokenizer) as load_tokenizer,
    ):
        run_tiny(tmp_path, "trainer.save_model=false", "trainer.max_steps=1")
    assert [c.args[1] for c in load_queries.call_args_list] == ["data.train_file", "data.dev_file"]
    assert load_tokenizer.call_count == 1


def test_fault_injection_costs_the_loop_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv("LYCHEE_FAULT", raising=False)
    assert fault_hook(0) is None  # the training loop then calls nothing per step
    monkeypatch.setenv("LYCHEE_FAULT", "1:3:raise")
    assert fault_hook(0) is None  # another rank's fault
    hook = fault_hook(1)
    hook(2, None)  # not yet
    with pytest.raises(RuntimeError, match="injected fault on rank 1 at step 3"):
        hook(3, None)
    monkeypatch.setenv("LYCHEE_FAULT", "1:3:oom:-1:4")  # any trial, only at per-device batch 4 or more
    assert fault_hook(1, 5, batch_size=2) is None  # the OOM retry's half batch fits
    assert fault_hook(1, 5, batch_size=4) is not None and fault_hook(1, -1, batch_size=8) is not None


def test_trainer_gradient_is_autograd_of_the_plain_mean_loss(tmp_path):
    """The trainer's accumulated gradient (2 micro-batches, forward chunks) equals autograd of the mean over the
    window's queries of Lychee's loss written out here (-log p(yes) for the positive, -log p(no) for negatives,
    averaged over each group), and the logged grad_norm is that gradient's norm before clipping."""
    from lychee_exp.parallel.devices import plan_devices
    from lychee_exp.parallel.distributed import DistEnv
    from lychee_exp.train.optim import optimizer_step
    from lychee_exp.train.trainer import Trainer

    cfg = to_run_config(
        compose_config(
            [
                *TINY_OVERRIDES,
                "loss=pointwise",
                "trainer.grad_accum_steps=2",
                "trainer.forward_chunks=2",
                "optimizer.max_grad_norm=1e-3",  # clipping active: the logged norm must still be the pre-clip one
            ],
            tmp_path,
        )
    )
    trainer = Trainer(cfg, DistEnv(), plan_devices("single", 1, cuda_count=0, cpu_threads_per_rank=1), tmp_path)
    trainer.setup()
    trainer.data.sampler.set_epoch(0)
    loader = iter(trainer.data.loader)
    batches = [next(loader), next(loader)]
    group = cfg.data.train_group_size
    queries = sum(len(b["input_ids"]) for b in batches) // group
    assert queries == 4
    trainer.step.accumulate(iter(batches), 2, queries)
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    got = {n: p.grad.detach().clone() for n, p in params.items()}

    trainer.model.zero_grad(set_to_none=True)
    per_query = []
    for b in batches:
        logits = trainer.model(b["input_ids"], b["attention_mask"]).view(-1, group)  # logit(yes) - logit(no)
        # -log sigmoid(z) for the positive (first), -log(1 - sigmoid(z)) for each negative
        per_pair = torch.cat([F.softplus(-logits[:, :1]), F.softplus(logits[:, 1:])], dim=1)
        per_query.append(per_pair.mean(dim=1))
    torch.cat(per_query).mean().backward()
    norm = 0.0
    for name, param in params.items():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
        norm += float(param.grad.double().pow(2).sum())
    for name, param in params.items():
        param.grad = got[name]
    logged = optimizer_step(trainer.model, trainer.optimizer, trainer.scheduler, trainer.scaler, cfg.optimizer)
    assert logged == pytest.approx(math.sqrt(norm), rel=1e-5)
    trainer.cleanup()


def test_step_timer_is_the_wall_clock_between_step_end_stamps():
    from lychee_exp.tracking.throughput import WARMUP_STEPS, StepTimer

    timer = StepTimer(0, 5, now=0.0)
    for step, end in enumerate([1.0, 2.0, 3.0, 4.5, 6.0], start=1):
        timer.add(step, end, wait=0.1, busy=0.2, queries=2, tokens=10, padded=12)
    assert timer.timed_from == WARMUP_STEPS == 2
    # steps 3-5: from the end of step 2 to the end of step 5, whatever ran between the steps
    assert timer.sums["time"] == 4.0 and timer.sums["queries"] == 6 and timer.sums["wait"] == pytest.approx(0.3)
    short = StepTimer(0, 2, now=0.5)  # too short to skip warm-up: timed from before its first step
    short.add(1, 1.0, 0, 0, 2, 10, 12)
    short.add(2, 2.5, 0, 0, 2, 10, 12)
    assert short.sums["time"] == 2.0 and short.sums["queries"] == 4


def test_throughput_counts_what_runs_between_steps(tmp_path):
    """A per-step stop-request collective (here a 0.2 s stand-in) is part of training time: samples/s must count
    it, as the peer benchmark's wall clock counts everything a peer does between steps."""
    import time

    from lychee_exp.parallel.devices import plan_devices
    from lychee_exp.parallel.distributed import DistEnv
    from lychee_exp.train.progress import StepHooks
    from lychee_exp.train.trainer import train_on_rank

    def slow_stop_request() -> bool:
        time.sleep(0.2)
        return False

    cfg = to_run_config(
        compose_config(
            [*TINY_OVERRIDES, "trainer.max_steps=5", "trainer.evaluate=false", "trainer.save_model=false"], tmp_path
        )
    )
    plan = plan_devices("single", 1, cuda_count=0, cpu_threads_per_rank=1)
    metrics = train_on_rank(cfg, DistEnv(), plan, tmp_path, hooks=StepHooks(stop_requested=slow_stop_request))
    # 3 timed steps of 2 queries, each at least 0.2 s long: at most 10 queries/s
    assert 0 < metrics["train_samples_per_s"] <= 2 / 0.2
