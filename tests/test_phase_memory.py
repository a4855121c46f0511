"""Peak resident memory per phase (lychee_exp.tracking.phases) and the cut that bounds scoring's: a run's
metrics.json and end-of-run line name each phase's peak, and a long batch scored a part at a time gives the same
logits while holding a fraction of one pass's activations (issue 54: a rank peaked at 3.85 GB in the BEIR flow's
final evaluation)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import TINY_OVERRIDES
from test_bi_encoder import bi_encoder_config

import lychee_exp.ir.evaluate as ev
from lychee_exp.config.schema import ModelConfig
from lychee_exp.job.in_process import run_job
from lychee_exp.model.precision import autocast
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer
from lychee_exp.tracking.memory import peak_rss_mb, reset_peak_rss, rss_mb
from lychee_exp.tracking.phases import HANDED_ENV, PhasePeaks, hand_down, handed_down, summary_line

MB = 2**20


def _hold(mb: int) -> bytearray:
    return bytearray(b"\x01") * (mb * MB)  # written, so resident


def test_a_phase_counts_its_own_peak_and_a_nested_one_apart():
    peaks = PhasePeaks()
    with peaks.phase("training"):
        with peaks.phase("evaluation"):
            held = _hold(300)
            del held
        small = _hold(20)
    del small
    assert peaks.peaks["evaluation"] - peaks.peaks["training"] > 200  # training's segments never held the 300 MB
    reset_peak_rss()
    assert peak_rss_mb() < peaks.peaks["evaluation"] - 200  # the mark starts again where a phase ends


def _bi_encoder() -> tuple[ModelConfig, object, torch.nn.Module]:
    cfg = bi_encoder_config()
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    return cfg, encoder, load_reranker(cfg, encoder, seed=0, training=True).eval()  # a new head is fine here


def _long_pairs(count: int, repeats: int = 8) -> list[tuple[str, str, str]]:
    text = "The heap queue algorithm keeps the smallest item at index zero of a list. "
    return [("", f"query {i} about heaps", text * (repeats + i % 5)) for i in range(count)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_scoring_a_batch_in_parts_gives_the_logits_of_one_pass(precision):
    """The bi-encoder (the BEIR recipe's model), in parts as scoring cuts them (bi_encoder.row_parts: equal, each
    thousands of slots). Parts of a few hundred slots are not bit-equal under bf16 on this CPU (0.02 on the logit:
    another matrix kernel), which is why row_parts never cuts a batch finer than it must."""
    _, encoder, model = _bi_encoder()
    batch = encoder.pad(encoder.encode_many(_long_pairs(40)))
    with torch.inference_mode(), autocast("cpu", precision):
        whole = model(batch["input_ids"], batch["attention_mask"])
        parts = model(batch["input_ids"], batch["attention_mask"], max_tokens=batch["input_ids"].numel() // 3)
    assert torch.equal(whole, parts)


def test_scoring_holds_a_fraction_of_one_pass(monkeypatch):
    """The cut measured against the behaviour before it (one forward per batch), in this process: the scoring of
    96 long pairs in one batch raises the peak by under half as much in parts as in one pass, with the same
    scores. A regression (parts dropped, or a budget that lets a batch through whole) fails it."""
    _, encoder, model = _bi_encoder()
    token_ids = encoder.encode_many(_long_pairs(96))

    def added_peak() -> tuple[float, list[float]]:
        scores = ev.score_token_ids(model, encoder, token_ids, 96, torch.device("cpu"))  # warm: kernels, arenas
        reset_peak_rss()
        before = rss_mb()
        scores = ev.score_token_ids(model, encoder, token_ids, 96, torch.device("cpu"))
        return peak_rss_mb() - before, scores

    monkeypatch.setattr(ev, "SCORING_TOKENS", 10**9)  # one forward per batch, as before the cut
    whole, whole_scores = added_peak()
    monkeypatch.setattr(ev, "SCORING_TOKENS", 2048)
    parts, parts_scores = added_peak()
    assert parts_scores == whole_scores
    assert whole > 40 and parts < whole / 2, (whole, parts)


def test_a_ddp_run_reports_each_phase_peak_per_rank(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lychee_exp")
    overrides = [*TINY_OVERRIDES, "parallel=ddp", "gpus=2", "trainer.max_steps=2", "trainer.save_model=false"]
    _, m = run_job(overrides, tmp_path / "run")
    param_mb = m["param_bytes_per_rank"][0] / MB
    for phase in ("load", "training", "evaluation"):
        per_rank = m[f"peak_rss_mb_{phase}_per_rank"]
        assert len(per_rank) == 2 and min(per_rank) > 0 and m[f"peak_rss_mb_{phase}"] == max(per_rank), phase
        assert min(per_rank) >= param_mb, phase  # every rank holds the model's weights throughout
    # the run's peak per rank is its highest phase's (the phases reset the mark, not the run's figure)
    for rank, peak in enumerate(m["peak_memory_mb_per_rank"]):
        assert peak >= max(m[f"peak_rss_mb_{p}_per_rank"][rank] for p in ("load", "training", "evaluation"))
    assert m["hydra_peak_rss_mb_checks"] > 0 and m["hydra_peak_rss_mb_ranks"] > 0
    assert "hydra_peak_rss_mb_mining" not in m  # data=sample has no data steps
    line = summary_line(m)
    assert line.startswith("peak RSS: load ") and "(the busiest of 2 ranks); Hydra process: checks " in line
    assert f"evaluation {m['peak_rss_mb_evaluation'] / 1024:.2f} GB" in line
    assert line in caplog.text


def test_a_run_without_the_figures_has_no_line():
    assert summary_line({"steps": 3}) is None


def test_the_hydra_process_phases_reach_the_ranks_logger_summary(monkeypatch):
    """What the Hydra process hands down in the environment its ranks start with is what rank 0 adds to its
    logger summary (W&B's): the Hydra phases by their metrics.json keys, nothing else."""
    monkeypatch.setenv(HANDED_ENV, "{}")  # and gone again after the test, whatever hand_down sets
    assert handed_down() == {}
    hand_down({"mining": 700.0, "dense_teacher": 650.5, "load": 1.0})  # a rank phase is not the Hydra process's
    assert handed_down() == {"hydra_peak_rss_mb_mining": 700.0, "hydra_peak_rss_mb_dense_teacher": 650.5}
