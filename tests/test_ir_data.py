"""BEIR and TREC files: each bad input gets one line naming the file and line (or the id); the corpus is parsed
once and cached by file identity; run files round-trip; first stages skip the query's own id."""

from __future__ import annotations

import json
import os

import pytest
from beir_helpers import fruit_dataset, write_beir

from lychee_exp.errors import UserError
from lychee_exp.ir import beir
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.pipeline import open_split
from lychee_exp.ir.trec import read_qrels, read_run, write_qrels, write_run

DOCS = {"d1": "one", "d2": "two", "d3": "three"}
QUERIES = {"q1": "first", "q2": "second"}


def _dataset(tmp_path, qrels=None):
    return write_beir(tmp_path / "ds", DOCS, QUERIES, qrels or {"train": {"q1": {"d1": 1}, "q2": {"d2": 2}}})


@pytest.mark.usefixtures("ir_cache")
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda d: (d / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n\n{"_id": "d2", "text": \n'),
            "corpus.jsonl:3: not valid JSON",
        ),
        (
            lambda d: (d / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n{"text": "y"}\n'),
            "corpus.jsonl:2: '_id' must be",
        ),
        (
            lambda d: (d / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n{"_id": "d1", "text": "y"}\n'),
            "document id 'd1' appears twice",
        ),
        (
            lambda d: (d / "queries.jsonl").write_text('{"_id": "q1", "text": "x"}\n{"_id": "q2"}\n'),
            "queries.jsonl:2: 'text' must be",
        ),
        (
            lambda d: (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\n"),
            "train.tsv:2: expected 'query-id",
        ),
        (
            lambda d: (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\thigh\n"),
            "train.tsv:2: expected",
        ),
        (
            lambda d: (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td9\t1\n"),
            "document id 'd9' (query 'q1') is not in",
        ),
        (
            lambda d: (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq7\td1\t1\n"),
            "query id 'q7' is not in",
        ),
        (
            lambda d: (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n"),
            "no judgements (an empty split)",
        ),
        (
            lambda d: (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t0\n"),
            "judges no document relevant",
        ),
        (lambda d: (d / "qrels" / "train.tsv").unlink(), "split=train: no "),
        (lambda d: (d / "corpus.jsonl").unlink(), "has no corpus.jsonl"),
    ],
)
def test_each_bad_input_gets_one_line_naming_where(tmp_path, damage, expected):
    root = _dataset(tmp_path)
    damage(root)
    with pytest.raises(UserError) as err:
        open_split(str(root), "train")
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_split_lists_the_splits_there(tmp_path, ir_cache):
    with pytest.raises(UserError, match=r"split=dev: no .*dev.tsv; splits here: train$"):
        open_split(str(_dataset(tmp_path)), "dev")


def test_the_corpus_is_parsed_once_then_read_from_the_cache_until_the_file_changes(tmp_path, ir_cache, monkeypatch):
    root = _dataset(tmp_path)
    first = beir.load_corpus(root)
    assert first.ids == ["d1", "d2", "d3"] and first.text("d2") == "two"

    def no_parse(path):
        raise AssertionError("parsed again")

    monkeypatch.setattr(beir, "_jsonl", no_parse)
    assert beir.load_corpus(root).texts == first.texts  # from the cache
    monkeypatch.undo()
    monkeypatch.setenv("LYCHEE_CACHE_DIR", str(ir_cache))
    (root / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "T", "text": "new"}) + "\n")
    os.utime(root / "corpus.jsonl", ns=(1, 1))  # a different mtime even on a coarse clock
    assert beir.load_corpus(root).texts == ["T new"]  # title and text, as BEIR's models read them


def test_trec_runs_and_qrels_round_trip_in_trec_eval_order(tmp_path):
    run = {"q2": {"a": 1.0, "b": 1.0, "c": 3.5}, "q1": {"x": -0.25}}
    write_run(tmp_path / "run.trec", run, "tag")
    lines = (tmp_path / "run.trec").read_text().splitlines()
    # ties by document id descending, as trec_eval orders them
    assert lines == [
        "q1 Q0 x 1 -0.250000 tag",
        "q2 Q0 c 1 3.500000 tag",
        "q2 Q0 b 2 1.000000 tag",
        "q2 Q0 a 3 1.000000 tag",
    ]
    assert read_run(tmp_path / "run.trec") == run
    qrels = {"q1": {"x": 2, "y": 0}}
    write_qrels(tmp_path / "qrels.txt", qrels)
    assert read_qrels(tmp_path / "qrels.txt") == qrels


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("q1 Q0 d1 1 0.5\n", "run.trec:1: expected 'qid Q0 docid rank score tag'"),
        ("q1 Q0 d1 1 high t\n", "run.trec:1: score 'high'"),
    ],
)
def test_a_malformed_run_line_is_named(tmp_path, text, expected):
    (tmp_path / "run.trec").write_text(text)
    with pytest.raises(UserError, match=expected):
        read_run(tmp_path / "run.trec")


def test_a_user_run_with_an_unknown_document_is_refused(tmp_path, ir_cache):
    corpus, split = open_split(str(_dataset(tmp_path)), "train")
    (tmp_path / "run.trec").write_text("q1 Q0 d1 1 2.0 t\nq1 Q0 zz 2 1.0 t\n")
    with pytest.raises(UserError, match="document id 'zz' is not in the corpus"):
        retrieve(f"run:{tmp_path / 'run.trec'}", corpus, split, 10)


def test_bm25_ranks_the_relevant_documents_first_and_skips_the_querys_own_id(tmp_path, ir_cache):
    root = fruit_dataset(tmp_path / "fruit")
    corpus, split = open_split(str(root), "test")
    run = retrieve("bm25", corpus, split, 5)
    assert set(run) == set(split.query_ids) and all(len(docs) == 5 for docs in run.values())
    for qid, docs in run.items():
        word = qid[2:]
        assert max(docs, key=docs.get) == f"{word}-a"
    assert (ir_cache / "bm25").is_dir() and list((ir_cache / "runs").glob("*.json"))
    # a document whose id is the query's is never a candidate (BEIR's ignore_identical_ids)
    docs = {**{d: corpus.text(d) for d in corpus.ids}, "q-apple": "how does the apple grow apple apple"}
    queries = {q: split.queries[q] for q in split.query_ids} | {"q-apple": "how does the apple grow"}
    root2 = write_beir(tmp_path / "self", docs, queries, {"test": {"q-apple": {"apple-a": 1}}})
    corpus2, split2 = open_split(str(root2), "test")
    assert "q-apple" not in retrieve("bm25", corpus2, split2, 5)["q-apple"]
