"""The whole GPU recipe on CPU: experiment=lychee_lora on the tiny Qwen2 with LoRA, gradient checkpointing, bf16
autocast, 2 gloo ranks and gradient accumulation trains, agrees with the single-process run, and saves a merged
model that reloads with the scores the run ended with."""

from __future__ import annotations

import pytest
import torch
from conftest import run_metrics
from safetensors.torch import load_file

from lychee_exp.config.schema import to_run_config
from lychee_exp.data.groups import build_dev_pairs
from lychee_exp.data.queries import load_queries
from lychee_exp.ir.evaluate import ranking_metrics, score_token_ids
from lychee_exp.job.in_process import compose_job, run_job
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer

pytestmark = pytest.mark.slow  # two training jobs (one of 2 ranks): ~45 s of CPU, minutes on a loaded machine

RECIPE = [
    "experiment=lychee_lora",
    "model.path=pkg://lychee_exp.assets/tiny_qwen2",
    "model.random_init=true",
    "model.dtype=float32",
    "model.lora.dropout=0",  # no dropout: rank and process RNG streams differ
    "model.lora.r=8",
    "model.lora.alpha=16",
    "model.gradient_checkpointing=true",  # the recipe says auto, which is off on a CPU: this test covers it on
    # fixed query counts (the recipe's token budget off): this test matches batch 4 against 2 x 1 x accumulation 2;
    # tests/test_token_budget.py covers the budget's DDP equivalence
    "data.max_tokens_per_batch=null",
    "data.packing=false",
    "data.max_train_queries=16",
    "data.max_dev_queries=6",
    "data.train_group_size=4",
    "data.random_negatives=0",
    "trainer.max_steps=3",
    "trainer.max_epochs=1",
    "trainer.precision=bf16",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "optimizer.lr=5e-3",
    "optimizer.lr_scaling=none",
    "logger=csv",
    "trainer.measure_speedup=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lychee_lora")
    single, ddp = tmp / "single", tmp / "ddp"
    run_job([*RECIPE, "parallel=single", "gpus=1", "data.batch_size=4"], single)
    run_job([*RECIPE, "parallel=ddp", "gpus=2", "data.batch_size=1", "trainer.grad_accum_steps=2"], ddp)
    return single, ddp


def test_recipe_is_lora_checkpointing_bf16_on_two_ranks(runs):
    single, ddp = runs
    cfg = to_run_config(compose_job([*RECIPE, "parallel=ddp", "gpus=2"], ddp / "x"))
    assert cfg.model.lora.enabled and cfg.model.gradient_checkpointing is True and cfg.model.kind == "causal_lm"
    m = run_metrics(ddp)
    assert m["num_devices"] == 2 and m["grad_accum_steps"] == 2 and m["precision"] == "bf16"
    assert m["effective_batch_size"] == run_metrics(single)["effective_batch_size"] == 4
    assert m["trainable_parameters"] < m["parameters"] / 2  # only the adapters train


def test_two_ranks_with_accumulation_match_one_process(runs):
    single, ddp = runs
    m_single, m_ddp = run_metrics(single), run_metrics(ddp)
    # bf16 autocast rounds differently for a batch of 4 and two micro-batches of 1: equal within bf16 tolerance
    assert m_ddp["train_loss"] == pytest.approx(m_single["train_loss"], rel=2e-2)
    w_single, w_ddp = (
        load_file(str(single / "model" / "model.safetensors")),
        load_file(str(ddp / "model" / "model.safetensors")),
    )
    assert w_single.keys() == w_ddp.keys() and not any("lora" in k for k in w_single)  # merged
    for name in w_single:
        torch.testing.assert_close(w_ddp[name], w_single[name], atol=2e-3, rtol=2e-2, msg=name)
    # it trained: the adapters moved the projections far more than the two runs differ
    init_cfg = to_run_config(compose_job([*RECIPE, "parallel=single", "gpus=1"], single / "x")).model
    initial = load_reranker(init_cfg, build_encoder(init_cfg, load_tokenizer(init_cfg)), seed=42)
    base = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in initial.backbone.state_dict().items()
        if "lora" not in k
    }
    name = next(k for k in w_single if k.endswith("q_proj.weight"))
    moved = (w_single[name] - base[name]).abs().max()
    assert moved > 10 * (w_ddp[name] - w_single[name]).abs().max() and moved > 1e-3


def test_merged_model_reloads_with_the_final_scores(runs, tmp_path):
    _, ddp = runs
    m = run_metrics(ddp)
    reload = to_run_config(
        compose_job(
            [
                *RECIPE,
                f"model.path={ddp / 'model'}",
                "model.random_init=false",
                "model.lora.enabled=false",
                "trainer.precision=fp32",
            ],
            tmp_path,
        )
    )
    tokenizer = load_tokenizer(reload.model)
    encoder = build_encoder(reload.model, tokenizer)
    pairs = build_dev_pairs(
        load_queries(reload.data.dev_file, "dev", reload.data.max_dev_queries),
        encoder,
        reload.data.instruction or reload.model.prompt.default_instruction,
        reload.seed,
    )
    scores = []
    for _ in range(2):  # two independent loads score identically
        model = load_reranker(reload.model, encoder, seed=123).eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores.append(score_token_ids(model, encoder, pairs.token_ids, 64, torch.device("cpu")))
    assert scores[0] == scores[1]
    reloaded = ranking_metrics(scores[0], pairs.labels, pairs.query_index)
    # data=sample ranks by the model mixed with the teacher (data.teacher_weight): the model alone is model_*
    assert reload.data.teacher_weight > 0
    assert reloaded["ndcg@10"] == pytest.approx(m["model_ndcg@10"], abs=1e-6)
    assert reloaded["mrr@10"] == pytest.approx(m["model_mrr@10"], abs=1e-6)
