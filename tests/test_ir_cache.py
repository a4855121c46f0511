"""The IR cache cannot change a result: a first-stage run is keyed by the queries asked (and their texts) and
read back with every query asked, those without candidates included; the same rerank command writes the same
run.trec, metrics.json and per_query.tsv on a cold and on a warm cache, for each first stage, after training's
max_dev_queries cached a cut run, and with a `run:` file that misses queries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from beir_helpers import fruit_dataset

from lychee_exp.cli import command_config
from lychee_exp.config.choices import Stemmer
from lychee_exp.config.commands import MineConfig, RerankConfig, register_ir_schemas
from lychee_exp.config.schema import DenseConfig
from lychee_exp.ir import first_stage
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.pipeline import open_split
from lychee_exp.ir.training import mine_train_split, score_dev_split
from lychee_exp.ir.trec import write_run
from lychee_exp.mine import mine_command
from lychee_exp.rerank import rerank_command

TINY = ["model=tiny_lychee", "model.random_init=true", "top_k=6", "batch_size=8", "progress_bar=false", "split=test"]
OUTPUTS = ("run.trec", "metrics.json", "per_query.tsv")


def _rerank(root, out, *extra):
    register_ir_schemas()
    cfg = command_config("rerank", [f"dataset={root}", f"out={out}", *TINY, *extra], RerankConfig)
    return rerank_command(cfg)


def _half_run(tmp_path, split) -> str:
    """A user's run holding only the first half of the split's queries (the others get no candidates)."""
    path = tmp_path / "half.trec"
    kept = split.query_ids[: len(split.query_ids) // 2]
    write_run(path, {q: {f"{q[2:]}-{s}": 4.0 - i for i, s in enumerate("dcba")} for q in kept}, "user")
    return f"run:{path}"


def _no_retrieval(monkeypatch):
    """From here on a first stage that retrieves again fails the test: a warm cache must answer."""

    def fail(*args, **kwargs):
        raise AssertionError("retrieved again instead of reading the cache")

    for name in ("_bm25", "_dense", "_user_run"):
        monkeypatch.setattr(first_stage, name, fail)


@pytest.mark.parametrize("stage", ["bm25", "dense", "run"])
def test_a_run_reads_back_from_the_cache_as_computed_with_every_query_asked(tmp_path, ir_cache, monkeypatch, stage):
    root = fruit_dataset(tmp_path / "fruit")
    corpus, split = open_split(str(root), "test")
    spec = _half_run(tmp_path, split) if stage == "run" else stage
    cold = retrieve(spec, corpus, split, 6)
    _no_retrieval(monkeypatch)
    warm = retrieve(spec, corpus, split, 6)
    assert warm == cold and list(warm) == list(cold) == split.query_ids
    if stage == "run":  # the queries the file misses stay, with no candidates
        assert [q for q, docs in warm.items() if not docs] == split.query_ids[3:]


@pytest.mark.parametrize("stage", ["bm25", "dense", "run"])
def test_rerank_writes_the_same_files_cold_and_warm_for_each_first_stage(tmp_path, ir_cache, monkeypatch, stage):
    root = fruit_dataset(tmp_path / "fruit")
    spec = _half_run(tmp_path, open_split(str(root), "test")[1]) if stage == "run" else stage
    cold = _rerank(root, tmp_path / "cold", f"first_stage={spec}")
    _no_retrieval(monkeypatch)
    warm = _rerank(root, tmp_path / "warm", f"first_stage={spec}")
    for name in OUTPUTS:  # timing (pairs/s) lives in timing.json, so metrics.json is byte for byte the same
        assert (tmp_path / "cold" / name).read_bytes() == (tmp_path / "warm" / name).read_bytes(), name
    assert cold["queries"] == cold["queries_judged"] == warm["queries_judged"] == 6
    assert cold["queries_scored"] == (3 if stage == "run" else 6)
    assert "pairs_per_s" not in (tmp_path / "cold" / "metrics.json").read_text()


@pytest.mark.parametrize("stage", ["bm25", "run"])
def test_mine_writes_the_same_file_cold_and_warm(tmp_path, ir_cache, monkeypatch, stage):
    root = fruit_dataset(tmp_path / "fruit")
    spec = _half_run(tmp_path, open_split(str(root), "train")[1]) if stage == "run" else stage
    register_ir_schemas()
    args = [
        f"dataset={root}",
        "split=train",
        f"first_stage={spec}",
        "range_min=1",
        "num_negatives=2",
        "progress_bar=false",
    ]
    cold = mine_command(command_config("mine", [*args, f"out={tmp_path / 'cold.jsonl'}"], MineConfig))
    _no_retrieval(monkeypatch)
    warm = mine_command(command_config("mine", [*args, f"out={tmp_path / 'warm.jsonl'}"], MineConfig))
    assert (tmp_path / "cold.jsonl").read_bytes() == (tmp_path / "warm.jsonl").read_bytes()
    assert cold.split(" (")[0].split(": ", 1)[1] == warm.split(" (")[0].split(": ", 1)[1]  # the summary, not the times
    assert len((tmp_path / "cold.jsonl").read_text().splitlines()) == (3 if stage == "run" else 6)


def test_a_cut_dev_run_cached_by_training_does_not_stand_in_for_the_whole_split(tmp_path, ir_cache, monkeypatch):
    root = fruit_dataset(tmp_path / "fruit")
    data = SimpleNamespace(
        dataset=str(root),
        dev_split="test",
        max_dev_queries=2,
        first_stage="bm25",
        rerank_top_k=6,
        dense=DenseConfig(),
        bm25_stemmer=Stemmer.porter,
        teacher_weight=0.0,
    )
    dev = score_dev_split(data)
    assert list(dev.run) == dev.split.query_ids and len(dev.run) == 2
    warm = _rerank(root, tmp_path / "warm")  # the 2-query run is in the cache
    monkeypatch.setenv("LYCHEE_CACHE_DIR", str(tmp_path / "fresh_cache"))
    _rerank(root, tmp_path / "cold")
    assert warm["queries"] == warm["queries_judged"] == 6 and warm["pairs"] == 36
    for name in OUTPUTS:
        assert (tmp_path / "cold" / name).read_bytes() == (tmp_path / "warm" / name).read_bytes(), name


def test_the_run_cache_is_keyed_by_the_query_texts(tmp_path, ir_cache):
    corpus, split = open_split(str(fruit_dataset(tmp_path / "fruit")), "test")
    before = retrieve("bm25", corpus, split, 3)
    split.queries["q-banana"] = "how does the cherry grow"  # same ids, another question
    after = retrieve("bm25", corpus, split, 3)
    assert max(before["q-banana"], key=before["q-banana"].get) == "banana-a"
    assert max(after["q-banana"], key=after["q-banana"].get) == "cherry-a"


def test_a_mined_train_file_is_mined_again_when_its_run_file_changes(tmp_path, ir_cache):
    root = fruit_dataset(tmp_path / "fruit")
    corpus, split = open_split(str(root), "train")
    run_file = tmp_path / "first.trec"
    docs = sorted(corpus.ids)
    write_run(run_file, {q: {d: float(i) for i, d in enumerate(docs)} for q in split.query_ids}, "user")
    data = SimpleNamespace(
        dataset=str(root),
        train_split="train",
        first_stage=f"run:{run_file}",
        dense=DenseConfig(),
        bm25_stemmer=Stemmer.porter,
    )
    first = mine_train_split(data)
    write_run(run_file, {q: {d: float(-i) for i, d in enumerate(docs)} for q in split.query_ids}, "user")
    second = mine_train_split(data)
    assert first != second and first.read_text() != second.read_text()
