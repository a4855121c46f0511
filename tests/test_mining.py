"""Hard-negative mining: negatives come from the first stage's ranks [range_min, range_max) only, never a judged
positive nor the query's own id, seeded per query; the margin guard drops what the teacher scores near the
positives; the command writes FlagEmbedding JSONL that training reads, with one summary line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from beir_helpers import fruit_dataset, mining, ranked_dataset

from lychee_exp.data.queries import load_queries
from lychee_exp.errors import UserError
from lychee_exp.ir.mining import mine
from lychee_exp.mine import main as mine_main


def test_negatives_stay_inside_the_rank_range_and_are_never_judged_positives(tmp_path, ir_cache):
    corpus, split, run, _ = ranked_dataset(tmp_path)
    # after the query's own id is skipped the run is d00..d39 in order: rank r holds d{r}
    lines, summary = mine(corpus, split, run, mining(10, 30, 50))
    (line,) = lines
    ids = line["neg_ids"]
    assert sorted(ids) == sorted(f"d{r:02d}" for r in range(10, 30) if r not in (12, 25))  # all 18 eligible
    assert "d15" in ids  # judged not relevant is a fine negative
    assert line["pos_ids"] == ["d03", "d12", "d25"] and line["pos_labels"] == [2, 1, 1]  # all positives, grades kept
    assert line["pos"][0] == corpus.text("d03") and line["neg"] == [corpus.text(d) for d in ids]
    assert summary.written == 1 and summary.negatives == 18
    few, _ = mine(corpus, split, run, mining(10, 30, 5, seed=1))
    again, _ = mine(corpus, split, run, mining(10, 30, 5, seed=1))
    other, _ = mine(corpus, split, run, mining(10, 30, 5, seed=2))
    assert len(few[0]["neg_ids"]) == 5 and set(few[0]["neg_ids"]) <= set(ids)
    assert few[0]["neg_ids"] == again[0]["neg_ids"] != other[0]["neg_ids"]


def test_a_query_without_candidates_in_range_is_skipped_and_said(tmp_path, ir_cache):
    corpus, split, run, _ = ranked_dataset(tmp_path)
    lines, summary = mine(corpus, split, run, mining(45, 60, 15))
    assert lines == [] and summary.written == 0
    assert "0 queries written, skipped: 1 without negatives in ranks 45-60" in summary.line()


def test_the_margin_drops_candidates_the_teacher_scores_near_the_positives(tmp_path, ir_cache):
    corpus, split, run, _ = ranked_dataset(tmp_path)
    score = {"d03": 5.0, "d12": 4.0, "d25": 6.0} | {
        f"d{i:02d}": float(i % 7) for i in range(40) if i not in (3, 12, 25)
    }
    asked = []

    def teacher(pairs):
        asked.extend(pairs)
        return [score[d] for _, d in pairs]

    lines, summary = mine(corpus, split, run, mining(10, 30, 50, absolute_margin=1.0), teacher)
    kept = lines[0]["neg_ids"]
    # the lowest positive scores 4.0: candidates above 4.0 - 1.0 = 3.0 are dropped
    assert kept and all(score[d] <= 3.0 for d in kept)
    eligible = [f"d{r:02d}" for r in range(10, 30) if r not in (12, 25)]
    assert sorted(kept) == sorted(d for d in eligible if score[d] <= 3.0)
    assert summary.dropped == {"absolute_margin": len(eligible) - len(kept)}
    assert lines[0]["pos_scores"] == [5.0, 4.0, 6.0] and lines[0]["neg_scores"] == [score[d] for d in kept]
    assert all(q == "q1" for q, _ in asked)


def test_the_command_writes_jsonl_that_training_reads(tmp_path, ir_cache):
    root = fruit_dataset(tmp_path / "fruit")
    out = tmp_path / "train.jsonl"
    args = [f"dataset={root}", "split=train", "first_stage=bm25", f"out={out}", "range_min=1", "range_max=10"]
    proc = subprocess.run(
        [sys.executable, "-m", "lychee_exp.mine", *args, "teacher=none", "num_negatives=3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "6 queries written, skipped: none; 3.00 negatives per query" in proc.stderr
    queries = load_queries(str(out), "data.train_file")
    assert len(queries) == 6 and all(len(q.neg) == 3 for q in queries)
    for line in map(json.loads, out.read_text().splitlines()):
        word = line["qid"][2:]
        assert line["pos_ids"] == [f"{word}-a", f"{word}-b"] and line["pos_labels"] == [2, 1]
        assert not {f"{word}-a", f"{word}-b"} & set(line["neg_ids"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["split=train", "range_min=20", "range_max=10"], "range_max must be > range_min"),
        (["split=train", "teacher=none", "margin=0.5"], "margin=0.5 needs a teacher's scores"),
        (["split=train", "teacher=none", "relative_margin=0.05"], "relative_margin=0.05 needs a teacher's scores"),
        (["split=train", "teacher=none", "max_score=0.9"], "max_score=0.9 needs a teacher's scores"),
        (["split=train", "teacher=none", "rank_by=teacher"], "rank_by=teacher needs a teacher's scores"),
        (["split=train", "margin=0.5", "absolute_margin=0.2"], "margin is an alias of absolute_margin"),
        (["split=train", "sampling=best"], "sampling"),
        (["split=train", "dense.pooling=max"], "dense.pooling"),
        (["split=train", "bm25_stemmer=lancaster"], "bm25_stemmer"),
        (["split=train", "dense_model=/no/encoder"], "dense_model=/no/encoder: /no/encoder does not exist"),
        (["split=train", "dense.model=/"], "dense.model=/: / is not a Hugging Face model directory"),
        (["split=train", "range_min=-1"], "range_min must be >= 0"),
        (["split=train", "teacher=none", "range_min=50", "range_max=60"], "no query has a negative to write"),
        (["split=train", "first_stage=splade"], "first_stage=splade: expected bm25, dense or run:"),
        (["split=nope"], "split=nope: no "),
        (["split=train", "num_negative=3"], "num_negative"),
    ],
)
def test_a_bad_mine_command_is_one_line(tmp_path, ir_cache, capsys, caplog, args, expected):
    """In this process (the CLI's start-up costs seconds): a composition error is printed, a UserError logged."""
    root = fruit_dataset(tmp_path / "fruit")
    with pytest.raises(SystemExit) as exit_:
        mine_main([f"dataset={root}", f"out={tmp_path / 'x.jsonl'}", *args])
    printed = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    lines = [line for line in printed if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "x.jsonl").exists()


def test_a_trained_reranker_as_teacher_writes_its_own_scores(tmp_path, ir_cache):
    """teacher=reranker: the written pos_scores/neg_scores are the model's logits on the same prompts (the tiny
    random Qwen2 here, seeded); a wrong model.path is one line before any scoring."""
    import torch

    from lychee_exp.cli import command_config
    from lychee_exp.config.commands import MineConfig, register_ir_schemas
    from lychee_exp.ir.evaluate import score_token_ids
    from lychee_exp.mine import mine_command
    from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer

    root = fruit_dataset(tmp_path / "fruit")
    out = tmp_path / "train.jsonl"
    register_ir_schemas()
    args = [f"dataset={root}", f"out={out}", "range_min=1", "range_max=10", "num_negatives=3", "teacher=reranker"]
    untrained = ["model=tiny_lychee", "model.random_init=true"]  # scored on purpose: its random weights
    cfg = command_config("mine", [*args, *untrained, "progress_bar=false"], MineConfig)
    mine_command(cfg)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    encoder = build_encoder(cfg.model, load_tokenizer(cfg.model))
    model = load_reranker(cfg.model, encoder, cfg.seed)
    instruction = cfg.model.prompt.default_instruction
    for line in lines:
        prompts = [(instruction, line["query"], doc) for doc in line["pos"] + line["neg"]]
        expected = score_token_ids(model, encoder, encoder.encode_many(prompts), 64, torch.device("cpu"))
        assert line["pos_scores"] + line["neg_scores"] == pytest.approx([round(s, 4) for s in expected], abs=2e-4)
    written = out.read_bytes()
    wrong = command_config("mine", [*args, "model=tiny_lychee", "model.path=/no/model", "overwrite=true"], MineConfig)
    with pytest.raises(UserError, match="model.path=/no/model: /no/model does not exist"):
        mine_command(wrong)
    assert out.read_bytes() == written  # a failed command replaces nothing, even with overwrite=true
