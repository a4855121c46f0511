"""Small BEIR-format datasets written by hand for the IR tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lychee_exp.config.commands import MineSettings
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.pipeline import open_split
from lychee_exp.ir.trec import write_run


def write_beir(root: Path, docs: dict[str, str], queries: dict[str, str], qrels: dict[str, dict]) -> Path:
    """qrels: split -> query id -> {doc id: relevance}."""
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": d, "title": "", "text": t}) + "\n" for d, t in docs.items())
    )
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    for split, judged in qrels.items():
        rows = "".join(f"{q}\t{d}\t{r}\n" for q, docs_ in judged.items() for d, r in docs_.items())
        (root / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows)
    return root


WORDS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "olive", "peach", "pear", "plum", "berry"]


def fruit_dataset(root: Path) -> Path:
    """12 queries (one fruit each), 48 documents: each fruit's two relevant documents (graded 2 and 1), plus
    documents that mention a fruit only in passing."""
    docs, queries, train, test = {}, {}, {}, {}
    for i, word in enumerate(WORDS):
        docs[f"{word}-a"] = f"all about the {word}: how the {word} grows and how to eat a {word}"
        docs[f"{word}-b"] = f"recipes with {word} and a history of the {word} tree"
        docs[f"{word}-c"] = f"a market sells many things, among them a {word} now and then"
        docs[f"{word}-d"] = f"weather report for the valley, sunny, no mention of fruit {i}"
        queries[f"q-{word}"] = f"how does the {word} grow"
        (train if i % 2 == 0 else test)[f"q-{word}"] = {f"{word}-a": 2, f"{word}-b": 1, f"{word}-c": 0}
    return write_beir(root, docs, queries, {"train": train, "test": test})


def mining(range_min: int, range_max: int, num_negatives: int, **given) -> MineSettings:
    """The settings a mining test means: its range and count, and a seeded (42) random sample over the first
    stage's ranking, no guard, unless it gives others."""
    chosen = {"sampling": "random", "rank_by": "first_stage", "seed": 42, **given}
    return MineSettings(range_min=range_min, range_max=range_max, num_negatives=num_negatives, **chosen)


def ranked_dataset(tmp_path: Path):
    """One query; its run ranks 40 documents d00..d39 in order; positives at ranks 3, 12 and 25 (0-based);
    d15 is judged not relevant (a true negative), and a document with the query's own id sits at rank 14."""
    docs = {f"d{i:02d}": f"text {i}" for i in range(40)} | {"q1": "the query itself"}
    qrels = {"train": {"q1": {"d03": 2, "d12": 1, "d25": 1, "d15": 0}}}
    root = write_beir(tmp_path / "ds", docs, {"q1": "a query"}, qrels)
    order = [f"d{i:02d}" for i in range(40)]
    order.insert(14, "q1")
    write_run(tmp_path / "run.trec", {"q1": {d: 100.0 - r for r, d in enumerate(order)}}, "t")
    corpus, split = open_split(str(root), "train")
    run = retrieve(f"run:{tmp_path / 'run.trec'}", corpus, split, 100)
    ranks = {d: r for r, d in enumerate(order)}
    return corpus, split, run, ranks


@pytest.fixture
def ir_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LYCHEE_CACHE_DIR", str(cache))
    return cache
