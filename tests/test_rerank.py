"""`python -m lychee_exp.rerank`: the same run file on 1 and 2 ranks, metrics.json equal to pytrec_eval on the
written run.trec and the split's qrels, bad inputs as one line before any rank starts; and data=beir training
whose dev evaluation reranks the first stage's top-k, inside a sweep trial."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import pytrec_eval
from beir_helpers import fruit_dataset

from lychee_exp.cli import command_config
from lychee_exp.config.commands import RerankConfig, register_ir_schemas
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.metrics import trec_metrics
from lychee_exp.ir.pipeline import open_split
from lychee_exp.ir.trec import read_qrels, write_qrels
from lychee_exp.rerank import main as rerank_main
from lychee_exp.rerank import rerank_command

TINY = ["model=tiny_lychee", "model.random_init=true", "top_k=6", "batch_size=5", "progress_bar=false", "split=test"]


def _rerank(root, out, *extra):
    register_ir_schemas()
    cfg = command_config("rerank", [f"dataset={root}", f"out={out}", *TINY, *extra], RerankConfig)
    return rerank_command(cfg)


def test_two_ranks_write_the_run_file_one_rank_writes_and_metrics_equal_pytrec_eval(tmp_path, ir_cache):
    root = fruit_dataset(tmp_path / "fruit")
    one = _rerank(root, tmp_path / "one", "parallel.cpu_threads_per_rank=1")
    two = _rerank(root, tmp_path / "two", "parallel=ddp", "gpus=2", "parallel.cpu_threads_per_rank=1")
    run_one, run_two = (tmp_path / "one" / "run.trec").read_text(), (tmp_path / "two" / "run.trec").read_text()
    assert run_one == run_two and len(run_one.splitlines()) == 6 * 6
    assert one["ranks"] == 1 and two["ranks"] == 2 and one["pairs"] == two["pairs"] == 36
    assert one["pairs_per_s"] > 0
    # metrics.json against pytrec_eval on the file as written, and the split's qrels
    _, split = open_split(str(root), "test")
    write_qrels(tmp_path / "qrels.txt", split.qrels)
    with (tmp_path / "one" / "run.trec").open() as handle:
        run = pytrec_eval.parse_run(handle)
    qrels = read_qrels(tmp_path / "qrels.txt")
    evaluated = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "map", "recall.6"}).evaluate(run)
    saved = json.loads((tmp_path / "one" / "metrics.json").read_text())
    for ours, theirs in (("ndcg@10", "ndcg_cut_10"), ("map", "map"), ("recall@6", "recall_6")):
        assert saved[ours] == pytest.approx(sum(q[theirs] for q in evaluated.values()) / len(evaluated), abs=1e-9)
    # the first stage beside it: BM25's own top-6 on the same queries
    corpus, split = open_split(str(root), "test")
    first = trec_metrics(retrieve("bm25", corpus, split, 6), split.qrels, 6, prefix="first_stage_")
    assert {k: saved[k] for k in first} == pytest.approx(first)
    assert set(saved) >= {"ndcg@10", "mrr@10", "recall@6", "map", "first_stage_ndcg@10", "first_stage_map"}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model.path=/nonexistent/model"], "model.path=/nonexistent/model: /nonexistent/model does not exist"),
        (["top_k=0"], "top_k must be >= 1, got 0"),
        (["first_stage=run:/no/such.trec"], "first_stage=run:/no/such.trec: /no/such.trec does not exist"),
        (["topk=5"], "topk"),
    ],
)
def test_a_bad_rerank_command_is_one_line_before_any_rank_starts(tmp_path, ir_cache, capsys, caplog, args, expected):
    root = fruit_dataset(tmp_path / "fruit")
    with pytest.raises(SystemExit) as exit_:
        rerank_main([f"dataset={root}", f"out={tmp_path / 'out'}", *TINY, *args])
    printed = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    lines = [line for line in printed if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_a_training_checkpoint_as_model_path_says_where_the_model_is(tmp_path, ir_cache, capsys, caplog):
    """train/checkpoint.py's step_N holds trainable weights and optimizer state, not a model to score with."""
    root, step = fruit_dataset(tmp_path / "fruit"), tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"")
    (step / "state.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        rerank_main([f"dataset={root}", f"out={tmp_path / 'out'}", *TINY, f"model.path={step}"])
    printed = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    lines = [line for line in printed if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and "a training checkpoint" in lines[0], lines
    assert "run's model/ directory" in lines[0]


@pytest.mark.slow
def test_data_beir_trains_and_evaluates_by_reranking_in_a_sweep_trial(tmp_path, ir_cache):
    from conftest import TINY_RANKS

    root = fruit_dataset(tmp_path / "fruit")
    args = [*TINY_RANKS, "data=beir", f"data.dataset={root}", "data.dev_split=test", "data.rerank_top_k=5"]
    args += ["parallel=ddp", "gpus=2", "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    args += ["data.train_group_size=3", "data.random_negatives=0"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "LYCHEE_FAULT"}
    proc = subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", "-m", "hparams_search=lr_batch", *args],
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    metrics = json.loads((tmp_path / "sweep" / "0" / "metrics.json").read_text())
    assert {"ndcg@10", "mrr@10", "map", "recall@5", "bm25_ndcg@10", "bm25_recall@5"} <= set(metrics)
    assert metrics["recall@5"] == metrics["bm25_recall@5"]  # a reranker reorders the top-5, it finds nothing new
    assert "rerank the bm25 top-5 of 6 queries" in proc.stdout + proc.stderr
    results = (tmp_path / "sweep" / "optimization_results.yaml").read_text()
    assert f"best_value: {metrics['model_ndcg@10']}" in results  # the model's own figure, not the mix with BM25
