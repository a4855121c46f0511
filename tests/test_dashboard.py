"""The W&B workspace definition (python -m lychee_exp.dashboard): built offline and inspected as the JSON that
--save would upload; no network is touched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from lychee_exp.tracking import wandb_workspace


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dashboard definition must build without network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def spec(no_network) -> dict:
    return wandb_workspace.definition(wandb_workspace.workspace("my-team", "lychee", "test view"))


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
        ("summary:num_devices", "summary:speedup"),
        ("summary:num_devices", "summary:scaling_efficiency"),
        ("summary:num_devices", "summary:train/samples_per_s"),
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
        "config:num_devices.value",
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


def test_throughput_section_shows_memory_tokens_and_data_wait(spec):
    # which names a real run records, and that the panels read them: test_panels_read_keys_that_a_real_run_records
    assert {"summary_metrics.peak_memory_mb", "train/tokens_per_s", "train/data_wait_share"} <= references(
        sections(spec)["Throughput & memory"]
    )


def test_dry_run_writes_json_offline_and_save_needs_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_MODE="offline")  # no ~/.netrc, so no key
    out = tmp_path / "workspace.json"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lychee_exp.tracking.wandb_workspace", "--entity", "e", "--project", "p", *args],
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


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory) -> dict:
    """What a real run recorded: a tiny job logged offline to W&B, read back from its .wandb file."""
    from conftest import TINY_OVERRIDES, run_cli

    from lychee_exp.tracking.wandb_records import find_run_files, read_run

    root = tmp_path_factory.mktemp("wandb_run")
    saved = {k: os.environ.get(k) for k in ("WANDB_API_KEY", "WANDB_MODE", "HOME", "WANDB_CONFIG_DIR")}
    os.environ.pop("WANDB_API_KEY", None)
    os.environ.pop("WANDB_MODE", None)
    os.environ.update(HOME=str(root / "home"), WANDB_CONFIG_DIR=str(root / "wandb-config"))  # no key: offline
    try:
        overrides = [*TINY_OVERRIDES, "trainer.max_steps=2", "trainer.eval_every=1", "trainer.save_model=false"]
        # its own process, as a user's run: wandb keeps per-process state (settings, mode) that earlier tests set
        proc = run_cli([*overrides, "logger=wandb"], root / "run")
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    (path,) = find_run_files(root / "run")
    return read_run(path)


def _config_value(config: dict, accessor: str):
    """config:optimizer.value.lr -> config["optimizer"]["lr"]; config:lr.value -> config["lr"]."""
    head, _, rest = accessor.removeprefix("config:").partition(".value")
    value = config[head]
    for part in filter(None, rest.split(".")):
        value = value[part]
    return value


def test_panels_read_keys_that_a_real_run_records(spec, recorded_run):
    """Checked against the records of an offline W&B run, not the dashboard's own list of names: every summary,
    config and history key a panel reads is one the run wrote, and every training/dev curve it wrote is plotted."""
    used = set().union(*(references(panels) for panels in sections(spec).values()))
    (runset,) = spec["spec"]["section"]["runSets"]
    used |= {c for c in runset["runFeed"]["columnOrder"] if c.startswith("summary_metrics.")}
    history = set().union(*(row.keys() for row in recorded_run["history"]))
    summary, config = recorded_run["summary"], recorded_run["config"]
    missing = []
    used = {f"summary:{k.removeprefix('summary_metrics.')}" if k.startswith("summary_metrics.") else k for k in used}
    for key in sorted(used):
        if key.startswith("summary:") and key.removeprefix("summary:") not in summary:
            missing.append(key)
        elif key.startswith("config:"):
            try:
                _config_value(config, key)
            except (KeyError, TypeError):
                missing.append(key)
        elif ":" not in key and key not in history and key != "Step":
            missing.append(key)
    assert not missing, f"panels read keys the run never recorded: {missing}"
    curves = {key for key in history if key.startswith(("train/", "dev/"))}
    assert curves and not curves - used, f"recorded but on no panel: {sorted(curves - used)}"
