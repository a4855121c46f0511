"""`rerank` as the field runs it: metrics.json equals pytrec_eval on the written run.trec at FlagEmbedding's cut-offs
(NDCG@k and Recall@k, k = 1, 3, 5, 10, 100), averaged over every judged query as trec_eval -c and BEIR count them
(a query judged with no relevant document, or with no candidates, scores 0); per_query.tsv averages to it; a split
without qrels gets run.trec and no metrics; mining and training's dev split treat zero-only queries as documented."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import pytrec_eval
from beir_helpers import fruit_dataset, mining

from lychee_exp.cli import command_config
from lychee_exp.config.choices import Stemmer
from lychee_exp.config.commands import RerankConfig, register_ir_schemas
from lychee_exp.config.schema import DenseConfig
from lychee_exp.ir.candidates import build_rerank_pairs
from lychee_exp.ir.metrics import trec_metrics
from lychee_exp.ir.mining import mine
from lychee_exp.ir.pipeline import open_split
from lychee_exp.ir.training import score_dev_split
from lychee_exp.ir.trec import write_run
from lychee_exp.mine import main as mine_main
from lychee_exp.rerank import rerank_command

TINY = ["model=tiny_lychee", "model.random_init=true", "top_k=6", "batch_size=8", "progress_bar=false"]
ZERO_ONLY = "q-apple"  # a train query, judged in test with no relevant document


def _rerank(root, out, *extra):
    register_ir_schemas()
    cfg = command_config("rerank", [f"dataset={root}", f"out={out}", *TINY, *extra], RerankConfig)
    return rerank_command(cfg)


def _dataset(tmp_path):
    root = fruit_dataset(tmp_path / "fruit")
    with (root / "qrels" / "test.tsv").open("a") as qrels:
        qrels.write(f"{ZERO_ONLY}\tapple-c\t0\n{ZERO_ONLY}\tapple-d\t0\n")
    return root


def _read_qrels(path) -> dict:
    """The qrels file read here, not by the code under test."""
    rows = list(csv.reader(path.open(), delimiter="\t"))[1:]
    qrels: dict = {}
    for qid, doc, rel in rows:
        qrels.setdefault(qid, {})[doc] = int(rel)
    return qrels


def test_metrics_equal_pytrec_eval_on_the_written_run_at_every_cut_off_over_every_judged_query(tmp_path, ir_cache):
    root = _dataset(tmp_path)
    # a user's first stage without two of the judged queries: they have no candidates and score 0
    _, split = open_split(str(root), "test")
    given = [q for q in split.query_ids if q not in ("q-berry", "q-pear")]
    run_file = tmp_path / "first.trec"
    write_run(run_file, {q: {f"{q[2:]}-{s}": 4.0 - i for i, s in enumerate("dbca")} for q in given}, "user")
    out = tmp_path / "out"
    _rerank(root, out, "split=test", f"first_stage=run:{run_file}")
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["queries"] == saved["queries_judged"] == 7 and saved["queries_scored"] == 5
    assert saved["queries_without_relevant"] == 1

    qrels = _read_qrels(root / "qrels" / "test.tsv")
    for name, prefix in (("run.trec", ""), ("first.trec", "first_stage_")):
        with (out / name if name == "run.trec" else run_file).open() as handle:
            run = pytrec_eval.parse_run(handle)
        measures = {"ndcg_cut.1,3,5,10,100", "recall.1,3,5,6,10,100", "map"}
        evaluated = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run)
        top10 = {q: dict(sorted(d.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:10]) for q, d in run.items()}
        rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
        expected = {"map": "map", "mrr@10": "recip_rank"}
        expected |= {f"ndcg@{k}": f"ndcg_cut_{k}" for k in (1, 3, 5, 10, 100)}
        expected |= {f"recall@{k}": f"recall_{k}" for k in (1, 3, 5, 6, 10, 100)}
        for ours, theirs in expected.items():
            table = rr if theirs == "recip_rank" else evaluated
            # trec_eval -c: a judged query missing from the run counts 0, the mean is over all 7
            mean = sum(table.get(q, {}).get(theirs, 0.0) for q in qrels) / len(qrels)
            assert saved[prefix + ours] == pytest.approx(mean, abs=1e-12), prefix + ours
    assert 0 < saved["ndcg@10"] < 1 and saved["recall@6"] != saved["recall@1"]

    rows = list(csv.DictReader((out / "per_query.tsv").open(), delimiter="\t"))
    assert sorted(r["qid"] for r in rows) == sorted(qrels)
    columns = [c for c in rows[0] if c != "qid"]
    assert "first_stage_ndcg@10" in columns and "recall@100" in columns and "mrr@10" in columns
    for column in columns:
        mean = sum(float(r[column]) for r in rows) / len(rows)
        assert saved[column] == pytest.approx(mean, abs=1e-12), column
    zero = next(r for r in rows if r["qid"] == ZERO_ONLY)
    assert all(float(zero[c]) == 0.0 for c in columns)


def test_a_split_without_qrels_writes_the_run_file_and_no_metrics(tmp_path, ir_cache, caplog):
    root = fruit_dataset(tmp_path / "fruit")
    (root / "qrels" / "test.tsv").unlink()
    out = tmp_path / "out"
    result = _rerank(root, out, "split=test")
    lines = (out / "run.trec").read_text().splitlines()
    assert len({line.split()[0] for line in lines}) == 12 and len(lines) == 12 * 6  # every query of queries.jsonl
    assert not (out / "metrics.json").exists() and not (out / "per_query.tsv").exists()
    assert "ndcg@10" not in result and result["queries"] == 12
    assert any("no qrels/test.tsv" in r.getMessage() and "no metrics" in r.getMessage() for r in caplog.records)


def test_mine_still_needs_the_qrels(tmp_path, ir_cache, capsys, caplog):
    root = fruit_dataset(tmp_path / "fruit")
    with pytest.raises(SystemExit) as exit_:
        mine_main([f"dataset={root}", "split=dev", f"out={tmp_path / 'train.jsonl'}", "teacher=none"])
    printed = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    lines = [line for line in printed if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and "split=dev: no " in lines[0], lines


def test_a_query_judged_without_a_relevant_document_or_without_candidates_counts_zero():
    qrels = {"a": {"d1": 1}, "zero": {"d2": 0}, "missed": {"d3": 1}}
    run = {"a": {"d1": 1.0, "d2": 0.5}, "zero": {"d2": 1.0}, "missed": {}}
    got = trec_metrics(run, qrels)
    assert got["ndcg@10"] == pytest.approx(1 / 3) and got["recall@100"] == pytest.approx(1 / 3)
    assert got["mrr@10"] == pytest.approx(1 / 3) and got["map"] == pytest.approx(1 / 3)


def test_zero_only_queries_are_evaluated_in_training_and_skipped_by_mining(tmp_path, ir_cache):
    root = _dataset(tmp_path)
    data = SimpleNamespace(dataset=str(root), dev_split="test", max_dev_queries=0, first_stage="bm25", rerank_top_k=4)
    data.dense, data.bm25_stemmer, data.teacher_weight = DenseConfig(), Stemmer.porter, 0.0
    dev = score_dev_split(data)
    assert ZERO_ONLY in dev.split.query_ids and len(dev.split.query_ids) == 7
    encoder = SimpleNamespace(encode_many=lambda prompts: [[1]] * len(prompts))
    pairs = build_rerank_pairs(dev.corpus, dev.split, dev.run, encoder, "", "bm25", 4)
    perfect = [float(label) for label in pairs.labels]  # the relevant documents first wherever retrieved
    assert trec_metrics(pairs.run_of(perfect), pairs.qrels, 4)["recall@4"] == pytest.approx(6 / 7)
    corpus, split = open_split(str(root), "test")
    lines, summary = mine(corpus, split, dev.run, mining(0, 4, 2))
    assert ZERO_ONLY not in {line["qid"] for line in lines} and len(lines) == 6
    assert summary.skipped["without a relevant document"] == 1 and "1 without a relevant document" in summary.line()
