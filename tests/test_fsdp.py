"""parallel=fsdp (FSDP2) on 2 CPU ranks (gloo) against one process on the same global steps: the same losses,
gradient norms, per-parameter gradients (gathered from the shards) and final weights, for full fine-tuning and
LoRA; each rank holding half the state; sharded checkpoints that resume to the uninterrupted run; a model/ that
transformers loads; a sweep on it; one-line errors for what it cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_metrics, warm_ranks_kept
from ddp_helpers import TINY_DDP, run_losses
from equivalence import assert_same_training
from gradient_helpers import spawned_windows, trainer_for, window_gradients

from lychee_exp.config.schema import to_run_config
from lychee_exp.errors import RunFailed, UserError
from lychee_exp.job.in_process import compose_job, run_job
from lychee_exp.parallel.memory_plan import plan_memory
from lychee_exp.parallel.sharding import transformer_blocks

# 2 ranks x 1 query x accumulation 2 against 1 process x 2 queries x accumulation 2: 4 queries a step either way
WINDOW = ["trainer.grad_accum_steps=2", "trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.eval_every=3"]
FSDP = [*TINY_DDP, *WINDOW, "parallel=fsdp", "gpus=2", "data.batch_size=1"]
SINGLE = [*TINY_DDP, *WINDOW, "parallel=single", "gpus=1", "data.batch_size=2"]
# Lychee's recipe: LoRA with activation checkpointing inside each sharded block; no LoRA dropout: the ranks' and
# the process's random streams differ
LORA = ["model.lora.enabled=true", "model.lora.dropout=0", "model.lora.r=8", "model.lora.alpha=16"]
LORA += ["model.gradient_checkpointing=true"]
TUNING = {"full": [], "lora": LORA}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(full|lora, fsdp|single|resumed) -> run directory; `resumed`: the fsdp run killed (SIGKILL of rank 0) after
    step 5, step 4's sharded checkpoint on disk, then run again with trainer.resume=auto."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {(tuning, kind): root / f"{tuning}-{kind}" for tuning in TUNING for kind in ("fsdp", "single", "resumed")}
    with warm_ranks_kept():
        for tuning, extra in TUNING.items():
            run_job([*SINGLE, *extra], out[tuning, "single"])
            run_job([*FSDP, *extra], out[tuning, "fsdp"])
        killed = out["full", "resumed"]
        with pytest.MonkeyPatch.context() as patch, pytest.raises(RunFailed, match="SIGKILL"):
            patch.setenv("LYCHEE_FAULT", "0:5:kill")
            run_job(FSDP, killed)
        assert (killed / "checkpoints" / "step_000004").is_dir() and not (killed / "metrics.json").exists()
        run_job([*FSDP, "trainer.resume=auto"], killed)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tuning", list(TUNING))
def test_fsdp_trains_as_one_process(runs, tuning):
    fsdp, single = runs[tuning, "fsdp"], runs[tuning, "single"]
    m_fsdp, m_single = run_metrics(fsdp), run_metrics(single)
    assert m_fsdp["strategy"] == "fsdp" and m_fsdp["num_devices"] == 2
    assert m_fsdp["effective_batch_size"] == m_single["effective_batch_size"] == 4
    assert run_losses(fsdp) == pytest.approx(run_losses(single), rel=1e-5)
    # every step's pre-clip gradient norm (the norm over all shards) and the saved weights
    assert_same_training(fsdp, single)
    # evaluation on sharded weights, batches in lock-step: the same dev metrics
    assert m_fsdp["initial_ndcg@10"] == pytest.approx(m_single["initial_ndcg@10"], abs=1e-6)
    assert m_fsdp["ndcg@10"] == pytest.approx(m_single["ndcg@10"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tuning", list(TUNING))
def test_each_rank_holds_half_the_state(runs, tuning, tmp_path):
    """Parameters, gradients and AdamW state per rank: the tensors' own sizes, shards under fsdp; and exactly what
    `python -m lychee_exp.plan` says before the run (parallel.memory_plan, from the model on the meta device)."""
    m_fsdp, m_single = run_metrics(runs[tuning, "fsdp"]), run_metrics(runs[tuning, "single"])
    for key in ("param_bytes_per_rank", "grad_bytes_per_rank", "optimizer_bytes_per_rank"):
        (whole,), shards = m_single[key], m_fsdp[key]
        assert len(shards) == 2 and whole > 0, key
        # dim-0 shards of odd-sized tensors differ by a row; AdamW's step counters are not sharded (4 bytes each)
        assert all(0.49 * whole < shard < 0.51 * whole for shard in shards), (key, shards, whole)
    for overrides, devices, measured in ((FSDP, 2, m_fsdp), (SINGLE, 1, m_single)):
        cfg = to_run_config(compose_job([*overrides, *TUNING[tuning]], tmp_path))
        plan = plan_memory(cfg, devices, "fp32", checkpointing=False)
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert plan.per_rank(key) == measured[f"{key}_per_rank"], (key, devices)
    if tuning == "lora":  # the frozen base is sharded too
        assert m_single["param_bytes_per_rank"][0] > 2 * m_single["grad_bytes_per_rank"][0]


@pytest.mark.slow
def test_killed_and_resumed_fsdp_run_ends_as_the_uninterrupted_one(runs):
    resumed, reference = runs["full", "resumed"], runs["full", "fsdp"]
    logs = [p.read_text() for p in resumed.glob("logs/**/0/stderr.log")]
    assert sum("resumed from" in text for text in logs) == 1
    assert_same_training(resumed, reference)
    step = resumed / "checkpoints" / "step_000006"
    shards = sorted(p.name for p in (step / "shards").iterdir())
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2  # one file per rank
    state = torch.load(step / "state.pt", weights_only=True)
    assert "optimizer" not in state and state["step"] == 6 and state["world_size"] == 2  # in the shards
    assert not (step / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("tuning", list(TUNING))
def test_model_dir_loads_with_transformers(runs, tuning):
    from transformers import AutoModelForCausalLM

    model_dir = runs[tuning, "fsdp"] / "model"
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    card = json.loads((model_dir / "lychee_reranker.json").read_text())
    assert card["kind"] == "causal_lm"
    assert (model_dir / "adapter").is_dir() == (tuning == "lora")


@pytest.mark.slow
def test_fsdp_gradients_are_one_process_gradients_per_parameter(tmp_path):
    """Token-budget packed batches of uneven query counts, accumulation 2 on each rank: one reduce-scatter per
    sharded module and window, not per micro-batch; every parameter's gradient gathered from the shards equals one
    process's on the union of the ranks' batches."""
    uneven = ["data.max_tokens_per_batch=2048", "data.packing=true", "data.max_train_queries=17"]
    uneven += ["data.bucket_by_length=true", "data.bucket_pool_batches=2"]
    # a window: 2 ranks x 2 micro-batches, the same 4 micro-batches in one process
    want = window_gradients(trainer_for(tmp_path / "single", *uneven, "trainer.grad_accum_steps=4"))
    ranks = spawned_windows(tmp_path, [*uneven, "trainer.grad_accum_steps=2"], strategy="fsdp")
    got = [rank["grads"] for rank in ranks]
    assert len(want) == len(got[0]) == len(got[1]) > 1
    # the tiny Qwen2's 2 decoder layers and the root: 3 sharded modules, each reduced once per window
    assert [len(rank["reductions"]) for rank in ranks] == [3 * len(want)] * 2
    for window, reference in enumerate(want):
        assert reference.keys() == got[0][window].keys()
        for name, grad in reference.items():
            scale = float(grad.abs().max())
            assert scale > 0, name
            for rank in (0, 1):
                torch.testing.assert_close(got[rank][window][name], grad, atol=1e-5 * scale, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_a_two_trial_sweep_on_fsdp(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = [*TINY_DDP, "parallel=fsdp", "gpus=2", "trainer.save_model=false", "trainer.global_batch_size=null"]
    cmd = [sys.executable, "-m", "lychee_exp.run", "-m", "hparams_search=lr_batch", *args]
    cmd += ["data.batch_size=choice(1,2)", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for trial in (0, 1):
        metrics = run_metrics(sweep_dir / str(trial))
        assert metrics["strategy"] == "fsdp" and len(metrics["optimizer_bytes_per_rank"]) == 2


def test_blocks_are_found_in_every_preset_kind():
    from transformers import BertConfig, BertForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

    small = {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 32}
    bert = BertForSequenceClassification(BertConfig(vocab_size=64, **small))
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, num_key_value_heads=1, **small))
    names = [type(b).__name__ for b in transformer_blocks(bert)]
    assert names.count("BertLayer") == 3 and set(names) <= {"BertLayer", "BertEmbeddings"}
    assert [type(b).__name__ for b in transformer_blocks(qwen)] == ["Qwen2DecoderLayer"] * 3
    assert transformer_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_cpu_offload_without_cuda_is_one_line():
    from lychee_exp.parallel.devices import plan_devices

    with pytest.raises(UserError, match="parallel.cpu_offload=true moves GPU state to CPU memory"):
        plan_devices("fsdp", 2, cuda_count=0, cpu_offload=True)
    assert plan_devices("fsdp", 2, cuda_count=0).strategy == "fsdp"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel=ddp", "parallel.cpu_offload=true"], "parallel.cpu_offload .* needs parallel=fsdp"),
        (["parallel=single", "parallel.reshard_after_forward=false"], "reshard_after_forward .* needs parallel=fsdp"),
        (["parallel=fsdp", "trainer.forward_chunks=4"], "trainer.forward_chunks=4 with parallel=fsdp"),
        (["parallel=fsdp", "trainer.precision=fp16"], "fp16 with parallel=fsdp: use bf16"),
    ],
)
def test_what_fsdp_cannot_do_is_one_line_before_any_process(compose_cfg, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message) as info:
        to_run_config(compose_cfg(overrides, tmp_path))
    assert "\n" not in str(info.value)
