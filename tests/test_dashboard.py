"""The W&B workspace definition (python -m lychee_exp.dashboard): built offline and inspected as the JSON that
--save would upload; no network is touched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from lychee_exp.tracking import dashboard


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dashboard definition must build without network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def spec(no_network) -> dict:
    return dashboard.definition(dashboard.workspace("my-team", "lychee", "test view"))


def sections(spec: dict) -> dict[str, list[dict]]:
    return {s["name"]: s["panels"] for s in spec["spec"]["section"]["panelBankConfig"]["sections"]}


def references(panels: list[dict]) -> set[str]:
    """Every metric / config / summary accessor a section's panels read."""
    out: set[str] = set()
    for panel in panels:
        config = panel["config"]
        out.update(config.get("metrics") or [])
        out.update(config[k] for k in ("xAxis", "yAxis") if config.get(k))
        out.update(column["accessor"] for column in config.get("columns") or [])
    return out


def test_workspace_has_the_four_sections(spec):
    assert spec["entity"] == "my-team" and spec["project"] == "lychee" and spec["displayName"] == "test view"
    assert list(sections(spec)) == ["Scaling", "Hyperparameters", "Training", "Throughput & memory"]
    assert all(panels for panels in sections(spec).values())


def test_scaling_plots_speedup_and_efficiency_against_world_size(spec):
    scatter = [p["config"] for p in sections(spec)["Scaling"] if p["viewType"] == "Scatter Plot"]
    pairs = {(c["xAxis"], c["yAxis"]) for c in scatter}
    assert {
        ("summary:world_size", "summary:speedup"),
        ("summary:world_size", "summary:scaling_efficiency"),
        ("summary:world_size", "summary:train/samples_per_s"),
    } <= pairs


def test_hyperparameters_compare_ndcg_against_lr_and_batch(spec):
    panels = sections(spec)["Hyperparameters"]
    (parallel,) = [p for p in panels if p["viewType"] == "Parallel Coordinates Plot"]
    accessors = [c["accessor"] for c in parallel["config"]["columns"]]
    # nested Hydra config: optimizer.lr is config.optimizer.lr; derived values are top-level keys
    assert accessors == [
        "config:optimizer.value.lr",
        "config:lr.value",
        "config:data.value.batch_size",
        "config:world_size.value",
        "config:effective_batch_size.value",
        "summary:dev/ndcg@10",
    ]
    scatter = {
        (p["config"]["xAxis"], p["config"]["yAxis"]): p["config"] for p in panels if p["viewType"] == "Scatter Plot"
    }
    assert scatter[("config:optimizer.value.lr", "summary:ndcg@10")]["xAxisLogScale"] is True
    assert ("config:effective_batch_size.value", "summary:ndcg@10") in scatter
    assert any(p["viewType"] == "Run Comparer" for p in panels)


def test_training_curves_are_grouped_by_run_group(spec):
    lines = [p["config"] for p in sections(spec)["Training"] if p["viewType"] == "Run History Line Plot"]
    grouped = {m for c in lines if c["groupBy"] == "group" for m in c["metrics"]}
    assert grouped == {"train/loss", "dev/ndcg@10"}
    assert all(c["groupAgg"] == "mean" and c["groupArea"] == "minmax" for c in lines if c["groupBy"])
    assert {"train/lr", "train/grad_norm", "dev/mrr@10"} <= references(sections(spec)["Training"])


def test_every_logged_name_appears_on_a_panel_or_the_runs_table(spec):
    used = set().union(*(references(panels) for panels in sections(spec).values()))
    (runset,) = spec["spec"]["section"]["runSets"]
    pinned = set(runset["runFeed"]["columnOrder"])  # the runs table's pinned columns
    for key in dashboard.HISTORY.values():
        assert key in used, key
    for key in dashboard.SUMMARY:
        assert {f"summary:{key}", f"summary_metrics.{key}"} & (used | pinned), key
    assert {"summary_metrics.peak_memory_mb", "train/tokens_per_s", "train/data_wait_share"} <= references(
        sections(spec)["Throughput & memory"]
    )
    for key in dashboard.CONFIG:
        head, *rest = key.split(".")
        assert f"config:{head}.value{''.join('.' + r for r in rest)}" in used, key


def test_dry_run_writes_json_offline_and_save_needs_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_MODE="offline")  # no ~/.netrc, so no key
    out = tmp_path / "workspace.json"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lychee_exp.tracking.dashboard", "--entity", "e", "--project", "p", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    proc = cli("--dry-run", str(out))
    assert proc.returncode == 0, proc.stderr
    assert list(sections(json.loads(out.read_text()))) == [
        "Scaling",
        "Hyperparameters",
        "Training",
        "Throughput & memory",
    ]
    proc = cli("--save")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "API key" in lines[0], proc.stderr
