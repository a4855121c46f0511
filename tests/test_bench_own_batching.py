"""The own-batching benchmark: every system's batches hold the same tokens, they are counted the same way, and a
tiny run yields one row per system, each having trained on 32 pairs a step."""

from __future__ import annotations

import csv
import json

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")

from lychee_exp.bench import own_batching, own_batching_loops  # noqa: E402
from lychee_exp.core.resources import resolve_path  # noqa: E402

SAMPLE = "pkg://lychee_exp.assets/sample/train.jsonl"


@pytest.fixture(scope="module")
def lychee_cfg(tmp_path_factory):
    from lychee_exp.core.config import to_run_config
    from lychee_exp.testing.jobs import compose_job

    return to_run_config(compose_job(own_batching.LYCHEE, tmp_path_factory.mktemp("cfg")))


@pytest.fixture(scope="module")
def tokenizer(lychee_cfg):
    from lychee_exp.core.model import load_tokenizer

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

    from lychee_exp.core.chunks import length_chunks
    from lychee_exp.core.model import Reranker, build_encoder, model_dir

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


@pytest.mark.slow
def test_tiny_run_gives_one_row_per_system_at_32_pairs_a_step(tmp_path, capsys):
    assert own_batching.main(["--steps", "2", "--rounds", "1", "--out", str(tmp_path)]) == 0
    with (tmp_path / "own_batching.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["system"] for r in rows] == list(own_batching.SYSTEMS)
    for r in rows:
        assert r["pairs_per_step"] == "32", r  # every timed step of every system: 8 queries x 4 documents
        assert r["timed_steps"] == "2" and r["rounds"] == "1"
        assert float(r["tokens_per_s"]) > 0 and float(r["pairs_per_s"]) > 0
        assert 0 <= float(r["padding_share"]) < 1
    assert max(float(r["vs_fastest_peer"]) for r in rows if r["system"] in own_batching.PEERS) == 1.0
    lychee = rows[-1]
    # lychee's own metric (sum of its step times) and the step-end clock time the same steps
    assert float(lychee["own_metric_tokens_per_s"]) == pytest.approx(float(lychee["tokens_per_s"]), rel=0.2)
    table = (tmp_path / "own_batching.md").read_text()
    assert "| system | pairs/s | non-pad tokens/s | vs fastest peer | padding share | pairs per step |" in table
    assert "loadavg" in table and "lychee_single" in capsys.readouterr().out
