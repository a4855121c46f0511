"""The model's scores mixed with its teacher's (ir/fusion.py): per-query standardisation, the mix in the dev
evaluation (data.teacher_weight) and in rerank (teacher_weight, or the weight the model's card records), with the
model alone and the teacher alone reported beside it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from beir_helpers import fruit_dataset
from conftest import compose_config
from test_model import _spread_weights, tiny_reranker

from lychee_exp.cli import command_config
from lychee_exp.config.commands import RerankConfig, register_ir_schemas
from lychee_exp.config.schema import DenseConfig, to_run_config
from lychee_exp.data.groups import DevPairs
from lychee_exp.errors import UserError
from lychee_exp.ir.candidates import RerankPairs
from lychee_exp.ir.evaluate import metrics_of, ranking_metrics
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.fusion import fuse, interpolate, standardise
from lychee_exp.ir.metrics import trec_metrics
from lychee_exp.ir.pipeline import dense_teacher, open_split
from lychee_exp.ir.trec import read_run
from lychee_exp.model.reranker import save_reranker
from lychee_exp.rerank import rerank_command, standing_line


def test_standardise_is_per_query_and_scale_free():
    groups = ["a", "a", "a", "b", "b"]
    z = standardise([1.0, 2.0, 3.0, 10.0, 10.0], groups)
    assert z[:3] == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)])
    assert z[3:] == [0.0, 0.0]  # a constant query: nothing to rank by
    # one query's scale and shift change nothing, of it or of another query
    assert standardise([100.0, 200.0, 300.0, 10.0, 10.0], groups) == pytest.approx(z)


def test_interpolate_weights_the_standardised_scores_and_zero_is_the_model_alone():
    groups = [0, 0, 0, 1, 1]
    model, teacher = [5.0, -1.0, 2.0, 0.3, 0.1], [0.1, 0.9, 0.5, 20.0, 40.0]
    assert interpolate(model, teacher, groups, 0.0) == model  # raw scores: the run is the model's
    zm, zt = standardise(model, groups), standardise(teacher, groups)
    mixed = interpolate(model, teacher, groups, 0.3)
    assert mixed == pytest.approx([0.7 * m + 0.3 * t for m, t in zip(zm, zt)])
    assert interpolate(model, teacher, groups, 1.0) == pytest.approx(zt)  # the teacher's ranking alone


def test_a_mix_can_rank_better_than_either_alone():
    """Two rankers that each put a different negative on top: the mix puts the positive first."""
    labels, groups = [1, 0, 0], [0, 0, 0]
    model, teacher = [2.0, 3.0, 0.0], [2.0, 0.0, 3.0]
    alone = [ranking_metrics(s, labels, groups)["ndcg@10"] for s in (model, teacher)]
    mixed = ranking_metrics(interpolate(model, teacher, groups, 0.5), labels, groups)["ndcg@10"]
    assert mixed == 1.0 and max(alone) < 1.0


def test_fixed_candidate_metrics_of_a_mix_equal_the_ranking_of_the_mixed_scores():
    pairs = DevPairs(query_index=[0, 0, 0, 1, 1], labels=[1, 0, 0, 0, 2], token_ids=[], texts=[])
    pairs.teacher_scores = [0.0, 1.0, 0.5, 3.0, 1.0]
    model = [1.0, 0.0, 0.2, 0.0, 0.4]
    mixed = interpolate(model, pairs.teacher_scores, pairs.query_index, 0.5)
    assert metrics_of(pairs, mixed, prefix="x_") == {
        f"x_{k}": v for k, v in ranking_metrics(mixed, pairs.labels, pairs.query_index).items()
    }


@pytest.fixture
def trained_dir(tmp_path):
    """A tiny Lychee model directory whose card records a teacher mix of 0.4."""
    cfg, tokenizer, _, reranker = tiny_reranker(tmp_path)
    _spread_weights(reranker.backbone)  # scores that differ, so the mix has something to mix
    ranking = {"teacher_weight": 0.4, "teacher": dataclasses.asdict(DenseConfig())}
    save_reranker(reranker, tokenizer, cfg, tmp_path / "model", ranking)
    return tmp_path / "model"


def _rerank(*args):
    register_ir_schemas()
    return rerank_command(command_config("rerank", list(args), RerankConfig))


def test_rerank_mixes_as_the_card_says_and_reports_model_and_teacher_alone(tmp_path, ir_cache, trained_dir):
    root = fruit_dataset(tmp_path / "fruit")
    out = tmp_path / "out"
    metrics = _rerank(f"dataset={root}", "split=test", "top_k=8", f"model.path={trained_dir}", f"out={out}")
    assert metrics["teacher_weight"] == 0.4  # from the card: no teacher_weight on the command line
    model_run = read_run(out / "run.model.trec")
    corpus, split = open_split(str(root), "test")
    keys = [(q, d) for q in split.query_ids for d in model_run[q]]
    teacher = dense_teacher(corpus, split, DenseConfig(), "dense.model")(keys)
    qids = [q for q, _ in keys]
    expected = interpolate([model_run[q][d] for q, d in keys], teacher, qids, 0.4)
    written = read_run(out / "run.trec")
    # run.trec holds the mix of the model's scores (as written, 6 decimals) with the teacher's
    assert [written[q][d] for q, d in keys] == pytest.approx(expected, abs=1e-4)
    teacher_run = {q: {} for q in split.query_ids}
    for (q, d), score in zip(keys, teacher):
        teacher_run[q][d] = score
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["teacher_ndcg@10"] == pytest.approx(trec_metrics(teacher_run, split.qrels, 8)["ndcg@10"], abs=1e-6)
    assert saved["model_ndcg@10"] == pytest.approx(trec_metrics(model_run, split.qrels, 8)["ndcg@10"], abs=1e-6)
    assert saved["ndcg@10"] == pytest.approx(trec_metrics(written, split.qrels, 8)["ndcg@10"], abs=1e-6)


def test_an_explicit_weight_wins_over_the_card_and_zero_ranks_by_the_model_alone(tmp_path, ir_cache, trained_dir):
    root = fruit_dataset(tmp_path / "fruit")
    out = tmp_path / "out"
    args = [f"dataset={root}", "split=test", "top_k=8", f"model.path={trained_dir}", f"out={out}", "teacher_weight=0"]
    metrics = _rerank(*args)
    assert metrics["teacher_weight"] == 0 and "model_ndcg@10" not in metrics
    assert not (out / "run.model.trec").exists()
    # the card names the teacher: its figures stand beside the model's and the first stage's all the same
    reference = _rerank(*args[:-2], f"out={tmp_path / 'mixed'}")
    assert metrics["teacher_ndcg@10"] == reference["teacher_ndcg@10"]
    assert metrics["ndcg@10"] == reference["model_ndcg@10"]
    line = standing_line(metrics, "bm25")
    assert line == (
        f"ndcg@10: model alone {metrics['ndcg@10']:.4f} vs first stage (bm25) "
        f"{metrics['first_stage_ndcg@10']:.4f} vs teacher {metrics['teacher_ndcg@10']:.4f}"
    )
    assert "(mix " in standing_line(reference, "bm25")
    alone = _rerank(*args[:-2], f"out={tmp_path / 'alone'}", "teacher_weight=0", "teacher_figures=false")
    assert "teacher_ndcg@10" not in alone and alone["ndcg@10"] == metrics["ndcg@10"]


def test_fuse_weighs_each_partner_and_leaves_the_model_the_rest():
    groups = [0, 0, 0, 1, 1]
    model, teacher, first = [5.0, -1.0, 2.0, 0.3, 0.1], [0.1, 0.9, 0.5, 20.0, 40.0], [12.0, 3.0, 7.5, 9.0, 1.0]
    zm, zt, zf = (standardise(s, groups) for s in (model, teacher, first))
    mixed = fuse(model, groups, [(teacher, 0.3), (first, 0.2)])
    assert mixed == pytest.approx([0.5 * m + 0.3 * t + 0.2 * f for m, t, f in zip(zm, zt, zf)])
    assert fuse(model, groups, [(teacher, 0.0), (first, 0.0)]) == model  # no weight: the model's raw scores
    assert fuse(model, groups, [(first, 0.2)]) == interpolate(model, first, groups, 0.2)


def test_the_dev_evaluation_mixes_the_first_stage_scores_of_a_beir_split():
    pairs = RerankPairs([0, 0, 0], [0, 1, 0], [[1], [2], [3]], [], qrels={"q": {"b": 1}}, first_stage={"q": {}})
    pairs.qids, pairs.doc_ids, pairs.first_stage_scores = ["q"] * 3, ["a", "b", "c"], [1.0, 9.0, 2.0]
    model = [3.0, 1.0, 2.0]  # the model ranks the relevant b last; BM25 ranks it first
    mixed = fuse(model, pairs.query_index, [(pairs.first_stage_scores, 0.6)])
    assert metrics_of(pairs, mixed)["ndcg@10"] == 1.0 and metrics_of(pairs, model)["ndcg@10"] == 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.first_stage_weight=0.2"], "only data=beir's dev split has a first stage"),
        (["data=beir", "data.teacher_weight=0.7", "data.first_stage_weight=0.5"], "exceeds 1"),
    ],
)
def test_a_mix_the_dev_split_cannot_make_is_one_line(args, message, tmp_path):
    with pytest.raises(UserError, match=message):
        to_run_config(compose_config(args, tmp_path))


def test_rerank_follows_the_cards_first_stage_weight(tmp_path, ir_cache):
    cfg, tokenizer, _, reranker = tiny_reranker(tmp_path)
    _spread_weights(reranker.backbone)
    ranking = {"teacher_weight": 0.0, "first_stage_weight": 0.3, "teacher": dataclasses.asdict(DenseConfig())}
    save_reranker(reranker, tokenizer, cfg, tmp_path / "model", ranking)
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    metrics = _rerank(f"dataset={root}", "split=test", "top_k=8", f"model.path={tmp_path / 'model'}", f"out={out}")
    assert metrics["first_stage_weight"] == 0.3 and metrics["teacher_weight"] == 0.0
    model_run, written = read_run(out / "run.model.trec"), read_run(out / "run.trec")
    corpus, split = open_split(str(root), "test")
    first = retrieve("bm25", corpus, split, 8)
    keys = [(q, d) for q in split.query_ids for d in model_run[q]]
    expected = fuse([model_run[q][d] for q, d in keys], [q for q, _ in keys], [([first[q][d] for q, d in keys], 0.3)])
    assert [written[q][d] for q, d in keys] == pytest.approx(expected, abs=1e-4)
    assert "teacher_ndcg@10" in metrics  # the card names the teacher: its figures beside the model's
