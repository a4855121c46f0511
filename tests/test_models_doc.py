"""docs/models.md's "Scoring a pair without lychee_exp" lines run as written against model directories saved
here (the shipped MiniLM as a cross-encoder, through transformers, sentence-transformers and FlagEmbedding's
FlagReranker; the tiny Qwen2 as a yes/no causal LM with each score, a LoRA run's
adapter on its base) and reproduce the project's own scores within 1e-4, in the same order."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO_ROOT
from huggingface_hub import ModelCard
from test_model import LORA, _spread_weights

from lychee_exp.cli import command_config
from lychee_exp.config.commands import RerankConfig, register_ir_schemas
from lychee_exp.ir.evaluate import score_token_ids
from lychee_exp.job.in_process import compose_job
from lychee_exp.model.files import ADAPTER_DIR
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer, save_reranker

BLOCK = re.compile(r"<!-- docs-test: (\S+) -->\n```python\n(.*?)```", re.S)
QUERIES = ["what is a lychee", "where do lychees grow", "is the lychee sweet"]
DOCS = [
    "Lychee is a tropical tree native to southern China, grown for its sweet fruit.",
    "The fruit has a rough pink-red skin and white flesh with a floral smell.",
    "Rain fell on the city all night.",
]
PAIRS = [(q, d) for q in QUERIES for d in DOCS]
# longer than the MiniLM preset's pair budget (96 tokens): the cut has to be the same on both sides
LONG = [(QUERIES[0], " ".join(DOCS * 8)), (QUERIES[1], " ".join(reversed(DOCS * 7)))]
# the cross-encoder blocks and the package each needs
CROSS_ENCODER_BLOCKS = {
    "cross_encoder_transformers": "transformers",
    "cross_encoder_sentence_transformers": "sentence_transformers",
    "cross_encoder_flag_embedding": "FlagEmbedding",
}


@pytest.fixture(scope="module")
def blocks():
    found = dict(BLOCK.findall((REPO_ROOT / "docs" / "models.md").read_text()))
    assert {*CROSS_ENCODER_BLOCKS, "causal_lm_load"} <= set(found)
    return found


def run_blocks(blocks, names, **inputs):
    namespace = dict(inputs)
    for name in names:
        exec(compile(blocks[name], f"docs/models.md:{name}", "exec"), namespace)  # noqa: S102
    return namespace


def training_cfg(tmp, *overrides):
    """The model a training job with these overrides trains (model.path's card and weights read as the job does)."""
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.job.training_job import with_model_resolved

    return to_run_config(with_model_resolved(compose_job(list(overrides), tmp / "run"))).model


def saved(tmp, *overrides, spread=None):
    """A model trained here in miniature: the preset's model, weights spread so that scores differ, saved."""
    cfg = training_cfg(tmp, *overrides)
    tokenizer = load_tokenizer(cfg)
    reranker = load_reranker(cfg, build_encoder(cfg, tokenizer), seed=0, training=True)
    (spread or _spread_weights)(reranker.backbone)
    out = tmp / "model"
    save_reranker(reranker, tokenizer, cfg, out)
    return out


def project_scores(model_dir, pairs):
    """What `rerank model.path=<model_dir>` scores (no model=: the directory's card says what it is)."""
    register_ir_schemas()
    cfg = command_config("rerank", ["dataset=/unused", "out=/unused", f"model.path={model_dir}"], RerankConfig).model
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    model = load_reranker(cfg, encoder, seed=0).eval()
    prompts = [(cfg.prompt.default_instruction, q, d) for q, d in pairs]
    return score_token_ids(model, encoder, encoder.encode_many(prompts), 4, torch.device("cpu"))


def assert_same_scores(theirs, ours):
    assert len(theirs) == len(ours) and torch.tensor(ours).std() > 0.05, ours  # scores that can disagree
    torch.testing.assert_close(torch.tensor(theirs, dtype=torch.float32), torch.tensor(ours), atol=1e-4, rtol=0)
    assert sorted(range(len(ours)), key=ours.__getitem__) == sorted(range(len(theirs)), key=theirs.__getitem__)


def _spread_head(backbone):
    with torch.no_grad():  # the new head's init (std 0.02) makes every pair score about the same
        backbone.classifier.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("minilm"), "model=minilm_cross_encoder", spread=_spread_head)


@pytest.mark.parametrize("block", sorted(CROSS_ENCODER_BLOCKS))
def test_cross_encoder_lines_reproduce_rerank(block, blocks, cross_encoder_dir):
    pytest.importorskip(CROSS_ENCODER_BLOCKS[block])
    pairs = PAIRS + LONG
    theirs = run_blocks(blocks, [block], model_dir=str(cross_encoder_dir), pairs=pairs)["scores"]
    assert_same_scores(theirs, project_scores(cross_encoder_dir, pairs))


def test_bi_encoder_lines_reproduce_rerank(blocks, tmp_path):
    pytest.importorskip("sentence_transformers")
    model_dir = saved(tmp_path, "model=minilm_bi_encoder")  # _spread_weights: away from the teacher
    theirs = run_blocks(blocks, ["bi_encoder_sentence_transformers"], model_dir=str(model_dir), pairs=PAIRS)
    assert_same_scores(theirs["scores"], project_scores(model_dir, PAIRS))


@pytest.mark.parametrize("score", ["yes_minus_no", "yes_logit"])
def test_causal_lm_lines_reproduce_rerank(score, blocks, tmp_path):
    model_dir = saved(tmp_path, "model=tiny_lychee", f"model.score={score}")
    theirs = run_blocks(blocks, ["causal_lm_load", "causal_lm_score"], model_dir=str(model_dir), pairs=PAIRS)
    assert theirs["card"]["score"] == score
    assert_same_scores(theirs["scores"], project_scores(model_dir, PAIRS))


def test_a_lora_runs_adapter_on_its_base_scores_as_the_merged_model(blocks, tmp_path):
    base = saved(tmp_path / "base", "model=tiny_lychee")  # a base with weights of its own

    def spread_adapters(backbone):
        with torch.no_grad():  # LoRA's B starts at zero: the adapter must change the scores to be checked
            for name, p in backbone.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.2)

    merged = saved(tmp_path, "model=tiny_lychee", f"model.path={base}", *LORA, spread=spread_adapters)
    adapter_config = json.loads((merged / ADAPTER_DIR / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base.resolve())
    card = json.loads((merged / "lychee_reranker.json").read_text())
    # the cards name the base (a random-init tiny_lychee: by its preset), never by a path
    assert card["adapter"] == ADAPTER_DIR and card["base_model"] == "tiny_lychee"
    peft_card = ModelCard.load(merged / ADAPTER_DIR / "README.md")  # peft's own card of the adapter
    assert peft_card.data.base_model == "tiny_lychee" and "base_model:adapter:tiny_lychee" in peft_card.data.tags
    assert str(tmp_path) not in (merged / "README.md").read_text() + str(peft_card)

    ours = project_scores(merged, PAIRS)
    assert max(abs(a - b) for a, b in zip(ours, project_scores(base, PAIRS))) > 1e-2  # the adapter matters
    names = ["causal_lm_load", "causal_lm_adapter", "causal_lm_score"]
    via_adapter = run_blocks(blocks, names, model_dir=str(merged), pairs=PAIRS)
    assert type(via_adapter["model"]).__name__.startswith("Peft")
    assert_same_scores(via_adapter["scores"], ours)
