"""benchmarks.harness, the one harness of the side-by-side benchmarks: turns, rounds, medians, the ratio to the
fastest peer and the written table, on hand-made figures (no training)."""

from __future__ import annotations

import csv
import json
import math

from benchmarks import harness


def test_every_round_runs_every_system_once_and_each_goes_first_in_turn():
    calls = []

    def run_one(name: str, round_: int):
        calls.append((round_, name))
        return None if (name, round_) == ("b", 1) else f"{name}{round_}"  # b fails in round 1

    results = harness.in_rounds(["a", "b", "c"], 3, run_one)
    assert [name for _, name in calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert results == {"a": ["a0", "a1", "a2"], "b": ["b0", "b2"], "c": ["c0", "c1", "c2"]}  # the failure left out


def test_medians_and_the_ratio_to_the_fastest_peer():
    runs = [{"tokens_per_s": v, "pairs_per_s": 1.0} for v in (90, 130, 120)]
    assert harness.medians(runs, ["tokens_per_s"]) == {"tokens_per_s": 120}
    rows = [
        {"system": "slow_peer", "tokens_per_s": 50.0},
        {"system": "fast_peer", "tokens_per_s": 100.0},
        {"system": "ours", "tokens_per_s": 120.0},
    ]
    harness.add_ratio_to_fastest(rows, ("slow_peer", "fast_peer"))
    assert [r["vs_fastest_peer"] for r in rows] == [0.5, 1.0, 1.2]
    mixed = [
        {"system": "fast_peer", "precision": "fp32", "tokens_per_s": 100.0},
        {"system": "fast_peer", "precision": "bf16", "tokens_per_s": 400.0},
        {"system": "ours", "precision": "fp32", "tokens_per_s": 120.0},
        {"system": "ours", "precision": "bf16", "tokens_per_s": 200.0},
        {"system": "ours", "precision": "fp16", "tokens_per_s": 200.0},
    ]
    harness.add_ratio_to_fastest(mixed, ("fast_peer",))  # each row against the peers of its own precision
    assert [r["vs_fastest_peer"] for r in mixed[:4]] == [1.0, 1.0, 1.2, 0.5]
    assert math.isnan(mixed[4]["vs_fastest_peer"])  # no fp16 peer: not a ratio to a peer of another precision
    lone = [{"system": "ours", "tokens_per_s": 1.0}]
    harness.add_ratio_to_fastest(lone, ("fast_peer",))  # no peer ran: no ratio rather than a division by zero
    assert math.isnan(lone[0]["vs_fastest_peer"])


def test_table_as_markdown_and_csv(tmp_path):
    rows = [
        {"system": "torch_loop", "pairs_per_s": 12.345, "tokens_per_s": 999.6, "vs_fastest_peer": 1.0,
         "padding_share": 0.25, "extra": "not written"},
    ]  # fmt: skip
    columns = [harness.SYSTEM, harness.PAIRS_PER_S, harness.TOKENS_PER_S, harness.VS_FASTEST_PEER]
    table = harness.markdown_table(rows, [*columns, harness.padding_column("padding")])
    assert table.splitlines() == [
        "| system | pairs/s | non-pad tokens/s | vs fastest peer | padding |",
        "|---|---|---|---|---|",
        "| torch_loop | 12.3 | 1000 | 1.00 | 25% |",
    ]
    harness.write_csv(tmp_path / "t.csv", rows, ["system", "tokens_per_s"])
    with (tmp_path / "t.csv").open() as handle:
        assert list(csv.DictReader(handle)) == [{"system": "torch_loop", "tokens_per_s": "999.6"}]


def test_a_child_process_prints_its_row_and_the_parent_does_nothing(capsys):
    def child(name: str, spec: dict) -> dict:
        return {"system": name, "steps": spec["steps"]}

    assert harness.child_call(["--steps", "3"], child) is False
    assert capsys.readouterr().out == ""
    assert harness.child_call([harness.CHILD_FLAG, "torch_loop", json.dumps({"steps": 3})], child) is True
    assert json.loads(capsys.readouterr().out) == {"system": "torch_loop", "steps": 3}


def test_precision_option_and_run_names():
    import argparse

    parser = argparse.ArgumentParser()
    harness.add_precision_option(parser)
    assert parser.parse_args([]).precision == ["fp32", "bf16"]  # both by default
    assert parser.parse_args(["--precision", "bf16"]).precision == ["bf16"]
    assert harness.split_run_name(harness.run_name("hf_trainer", "bf16")) == ("hf_trainer", "bf16")


def test_a_failed_child_is_reported_and_left_out(caplog):
    # a module that does not exist: the fresh process exits non-zero, and the harness logs its error
    assert harness.run_child("benchmarks.no_such_benchmark", "torch_loop", {}, {}) is None
    assert "torch_loop failed" in caplog.text and "No module named" in caplog.text
