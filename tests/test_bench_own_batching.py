"""The own-batching benchmark: every system's batches hold the same tokens, they are counted the same way, every
system runs in every precision (compared within it only), FlagEmbedding's runner reads the file itself and
trains, and a tiny run yields one row per system and precision, each having trained on 32 pairs a step."""

from __future__ import annotations

import csv
import json

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")

from benchmarks import harness, own_batching, own_batching_loops  # noqa: E402
from lychee_exp.io.user_files import resolve_path  # noqa: E402

SAMPLE = "pkg://lychee_exp.assets/sample/train.jsonl"


@pytest.fixture(scope="module")
def lychee_cfg(tmp_path_factory):
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.job.in_process import compose_job

    return to_run_config(compose_job(own_batching.LYCHEE, tmp_path_factory.mktemp("cfg")))


@pytest.fixture(scope="module")
def tokenizer(lychee_cfg):
    from lychee_exp.model.reranker import load_tokenizer

    return load_tokenizer(lychee_cfg.model)


def _tiny_classifier():
    """A 1-layer BERT with MiniLM's vocabulary: the metered forward path without the 88 MB weights."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_labels=1)
    config.intermediate_size = 64
    return BertForSequenceClassification(config).eval()


def test_every_system_reads_the_same_tokens_and_counts_them_alike(lychee_cfg, tokenizer):
    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers import BertForSequenceClassification, DataCollatorWithPadding

    from lychee_exp.data.packing import length_chunks
    from lychee_exp.model.reranker import Reranker, build_encoder, model_dir

    prompt = lychee_cfg.model.prompt
    template = prompt.prefix + prompt.separator + prompt.template
    path = resolve_path(SAMPLE, "data.train_file")
    raw = [json.loads(line) for line in path.read_text().splitlines()[:3]]
    pairs = own_batching_loops.read_pairs(path, tokenizer, prompt.query_max_len, prompt.doc_max_len)[:12]
    assert [p.label for p in pairs] == [1.0, 0.0, 0.0, 0.0] * 3
    # lychee cuts the raw file text itself; the peers get text cut at the same token: the same ids come out
    encoder = build_encoder(lychee_cfg.model, tokenizer)
    docs = [d for row in raw for d in row["pos"][:1] + row["neg"][:3]]
    lychee_ids = [encoder.encode("", raw[i // 4]["query"], doc) for i, doc in enumerate(docs)]
    texts = [own_batching_loops.prompt_text(template, p) for p in pairs]
    assert lychee_ids == tokenizer(texts)["input_ids"]
    assert max(len(ids) for ids in lychee_ids) > min(len(ids) for ids in lychee_ids)  # padding to count
    assert any(len(tokenizer(row["query"])["input_ids"]) > prompt.query_max_len for row in raw) or any(
        len(tokenizer(d)["input_ids"]) > prompt.doc_max_len for d in docs
    )  # a cut happened

    encoded = own_batching_loops.hf_tokenize(tokenizer, texts)
    rows = [{k: encoded[k][i] for k in encoded} | {"label": p.label} for i, p in enumerate(pairs)]
    batches = {
        "hf_trainer": DataCollatorWithPadding(tokenizer)(rows),
        "torch_loop": own_batching_loops.loop_collate(tokenizer, template, pairs),
        "lychee": encoder.pad(lychee_ids),
    }
    st = CrossEncoder(str(model_dir(lychee_cfg.model)), num_labels=1, device="cpu")
    batches["st_cross_encoder"] = st.preprocess([own_batching_loops.st_columns(template, p) for p in pairs])

    meter, original = own_batching_loops.Meter(), BertForSequenceClassification.forward
    undo = meter.wrap(BertForSequenceClassification)
    try:
        model = _tiny_classifier()
        with torch.no_grad():
            for name in ("hf_trainer", "torch_loop", "st_cross_encoder"):
                b = batches[name]
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                meter.stamp()
            lychee = Reranker(model, "sequence_classification")
            b = batches["lychee"]
            lychee(b["input_ids"], b["attention_mask"], chunks=length_chunks(b["attention_mask"].sum(-1).tolist(), 4))
            meter.stamp()
    finally:
        undo()
    assert BertForSequenceClassification.forward is original  # restored for the rest of the session
    counted = {}
    for k, name in enumerate(("hf_trainer", "torch_loop", "st_cross_encoder", "lychee")):
        a, b = ([0] + [n for _, n in meter.stamps])[k : k + 2]
        counted[name] = (sum(int(c[0]) for c in meter.calls[a:b]), sum(c[2] for c in meter.calls[a:b]))
    real = sum(len(ids) for ids in lychee_ids)
    assert counted["hf_trainer"] == counted["torch_loop"] == counted["lychee"] == (real, 12)
    # its documented pair input puts a [SEP] between the two columns: one token more per pair, counted as read
    assert counted["st_cross_encoder"] == (real + 12, 12)
    assert len(meter.calls) == 3 + 4  # lychee's 4 forward chunks each metered


def test_window_counts_only_the_steps_after_warmup():
    meter = own_batching_loops.Meter()
    for step, rows in enumerate([5, 6, 7, 8]):  # one forward per step, one row per real token
        meter.calls.append((torch.tensor(rows * 10), rows * 12, rows))
        meter.stamps.append((float(step), len(meter.calls)))
    w = meter.window(2)  # steps 3 and 4, from the end of step 2 (t=1) to the end of step 4 (t=3)
    assert w == {"seconds": 2.0, "steps": 2, "pairs": 15, "tokens": 150.0, "slots": 180, "pairs_per_step": [7, 8]}
    assert meter.window(1)["pairs_per_step"] == [6, 7, 8]
    with pytest.raises(RuntimeError, match="4 step ends"):
        meter.window(4)


def test_every_system_runs_in_every_precision_and_is_compared_within_it(tmp_path, monkeypatch):
    """A run per system and precision, lychee told its precision last; each ratio is to the fastest peer of the
    row's own precision (a bf16 lychee row against the fp32 peers would read 2.0 here, not 1.0)."""
    calls = []

    def fake_child(module, system, spec, env):
        calls.append((system, spec["precision"], spec["lychee_overrides"][-1]))
        speed = {"fp32": 100.0, "bf16": 200.0}[spec["precision"]]
        return {"pairs_per_s": 1.0, "tokens_per_s": speed, "padding_share": 0.1, "pairs_per_step": [32],
                "timed_steps": 1, "own_metric_tokens_per_s": float("nan")}  # fmt: skip

    monkeypatch.setattr(harness, "run_child", fake_child)
    rows = own_batching.measure(tmp_path, ["fp32", "bf16"], 1, 1, ["trainer.precision=fp32"])
    assert "flag_embedding" in own_batching.PEERS
    expected = [(system, p) for p in ("fp32", "bf16") for system in own_batching.SYSTEMS]
    assert [(r["system"], r["precision"]) for r in rows] == expected
    assert sorted(c[:2] for c in calls) == sorted(expected)
    assert all(last == f"trainer.precision={p}" for _, p, last in calls)
    assert [r["vs_fastest_peer"] for r in rows] == [1.0] * len(rows)


def test_flag_embedding_reads_the_file_itself_and_trains(tmp_path, monkeypatch):
    """FlagEmbedding's runner samples its query groups from the JSONL file: 2 queries x 4 documents a step, every
    step stamped, its model's reads metered, its weights moved; in bf16 its forward computes in bfloat16."""
    pytest.importorskip("FlagEmbedding")
    from transformers import BertForSequenceClassification

    from benchmarks.flag_peer import own_file

    spec = own_batching.build_spec(tmp_path, 2, 2, "cpu", [])
    spec.update(pairs_per_step=8, max_steps=3, precision="bf16")
    model, dtypes = _tiny_classifier().train(), []
    model.classifier.register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(own_batching_loops, "sequence_classifier", lambda spec: model)  # not the 88 MB MiniLM
    meter = own_batching_loops.Meter()
    monkeypatch.setattr(own_batching_loops, "METER", meter)
    undo = meter.wrap(BertForSequenceClassification)
    try:
        own_file(spec, str(tmp_path / "flag"))
    finally:
        undo()
    window = meter.window(1)
    assert window["steps"] == 2 and window["pairs_per_step"] == [8, 8]
    assert 0 < window["tokens"] < window["slots"]  # its own padding, counted as read
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert dtypes and set(dtypes) == {torch.bfloat16}


@pytest.mark.slow
def test_tiny_run_gives_one_row_per_system_at_32_pairs_a_step(tmp_path, capsys):
    assert own_batching.main(["--steps", "2", "--rounds", "1", "--out", str(tmp_path)]) == 0
    with (tmp_path / "own_batching.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["system"], r["precision"]) for r in rows] == [
        (system, p) for p in ("fp32", "bf16") for system in own_batching.SYSTEMS
    ]
    for r in rows:
        assert r["pairs_per_step"] == "32", r  # every timed step of every system: 8 queries x 4 documents
        assert r["timed_steps"] == "2" and r["rounds"] == "1"
        assert float(r["tokens_per_s"]) > 0 and float(r["pairs_per_s"]) > 0
        assert 0 <= float(r["padding_share"]) < 1
    for p in ("fp32", "bf16"):  # the fastest peer of each precision is its own 1.0
        assert (
            max(float(r["vs_fastest_peer"]) for r in rows if r["system"] in own_batching.PEERS and r["precision"] == p)
            == 1.0
        )
    for lychee in (r for r in rows if r["system"] == "lychee_single"):
        # `python -m lychee_exp.run`'s own figure, from the metrics.json of the run it left (the user's number)
        metrics = json.loads(
            (tmp_path / "round0" / f"lychee_single_{lychee['precision']}" / "run" / "metrics.json").read_text()
        )
        assert float(lychee["tokens_per_s"]) == pytest.approx(metrics["train_tokens_per_s"], rel=1e-6)
    table = (tmp_path / "own_batching.md").read_text()
    header = "| system | precision | pairs/s | non-pad tokens/s | vs fastest peer | padding share | pairs per step |"
    assert header in table
    assert "loadavg" in table and "lychee_single" in capsys.readouterr().out
