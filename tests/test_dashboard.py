"""The W&B workspace definition (python -m lychee_exp.dashboard): built offline and inspected as the JSON that
--save would upload; no network is touched. Its --dry-run file by the output policy of every command (an earlier
definition refreshed, anything else kept; a path naming no file and a full disk are one line). And W&B's own
files: WANDB_MODE=disabled writes none."""

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
        "summary:dev/model_ndcg@10",  # the model's own figure, what sweeps optimize
        "summary:dev/ndcg@10",  # the run's ranking (the mix) beside it
    ]
    scatter = {
        (p["config"]["xAxis"], p["config"]["yAxis"]): p["config"] for p in panels if p["viewType"] == "Scatter Plot"
    }
    assert scatter[("config:optimizer.value.lr", "summary:model_ndcg@10")]["xAxisLogScale"] is True
    assert ("config:effective_batch_size.value", "summary:model_ndcg@10") in scatter
    assert any(p["viewType"] == "Run Comparer" for p in panels)


def test_training_curves_are_grouped_by_run_group(spec):
    lines = [p["config"] for p in sections(spec)["Training"] if p["viewType"] == "Run History Line Plot"]
    grouped = {m for c in lines if c["groupBy"] == "group" for m in c["metrics"]}
    assert grouped == {"train/loss", "dev/model_ndcg@10"}
    assert all(c["groupAgg"] == "mean" and c["groupArea"] == "minmax" for c in lines if c["groupBy"])
    assert {"train/lr", "train/grad_norm", "dev/mrr@10", "dev/model_mrr@10"} <= references(sections(spec)["Training"])


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


# ----------------------------------------------------------------------- --dry-run by the output policy of commands
def dashboard(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    """`python -m lychee_exp.dashboard --entity e --project p <args>` in this process: status, stdout, stderr."""
    code = wandb_workspace.main(["--entity", "e", "--project", "p", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), [line for line in err.splitlines() if line.strip()]


CORPUS = '{"_id": "d1", "text": "the user\'s document"}\n'


def test_dry_run_replaces_its_own_definition_and_nothing_else_without_overwrite(tmp_path, capsys, no_network):
    """An earlier definition (recognised by its content) is refreshed without a flag; a user's file, JSON or not,
    is refused in one line and left byte for byte, and replaced only with --overwrite. Wrong code that would
    still pass: recognising any JSON object (the foreign JSON below is one)."""
    out = tmp_path / "workspace.json"
    assert dashboard(capsys, "--dry-run", str(out)) == (0, [str(out)], [])
    assert dashboard(capsys, "--dry-run", str(out), "--name", "renamed") == (0, [str(out)], [])
    assert json.loads(out.read_text())["displayName"] == "renamed"
    refusals = {  # a corpus makes its folder a dataset, which no output enters
        "corpus.jsonl": "error: --dry-run={mine} is inside {folder}, a dataset: write elsewhere",
        "settings.json": "error: --dry-run={mine} already holds results (settings.json): set --overwrite to replace "
        "them",
    }
    for name, text in (("corpus.jsonl", CORPUS), ("settings.json", '{"entity": "e", "project": "p"}\n')):
        folder = tmp_path / name.partition(".")[0]
        folder.mkdir()
        mine = folder / name
        mine.write_text(text)
        code, printed, errors = dashboard(capsys, "--dry-run", str(mine))
        assert code == 2 and printed == [] and len(errors) == 1, errors
        assert errors[0] == refusals[name].format(mine=mine, folder=folder)
        assert mine.read_text() == text
    assert dashboard(capsys, "--dry-run", str(tmp_path / "settings" / "settings.json"), "--overwrite")[0] == 0
    assert "spec" in json.loads((tmp_path / "settings" / "settings.json").read_text())


def test_dry_run_never_replaces_a_dataset_file_even_with_overwrite(tmp_path, capsys, no_network):
    from test_bench_outputs import tree

    dataset = tmp_path / "fruit"
    (dataset / "qrels").mkdir(parents=True)
    (dataset / "corpus.jsonl").write_text(CORPUS)
    (dataset / "queries.jsonl").write_text('{"_id": "q1", "text": "apple"}\n')
    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    before = tree(tmp_path)
    for target in (dataset / "corpus.jsonl", dataset / "qrels" / "test.tsv"):
        code, printed, errors = dashboard(capsys, "--dry-run", str(target), "--overwrite")
        assert code == 2 and printed == [] and len(errors) == 1 and errors[0].startswith(f"error: --dry-run={target}")
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("", "--dry-run= is empty"), ("{t}/out/", "ends with '/'"), ("{t}/" + "w" * 300 + ".json", "")],
    ids=["empty", "trailing-slash", "name-too-long"],
)
def test_a_dry_run_path_naming_no_file_is_one_line(tmp_path, capsys, no_network, spec, expected):
    spec = spec.format(t=tmp_path)
    code, printed, errors = dashboard(capsys, "--dry-run", spec)
    assert code == 2 and printed == [] and len(errors) == 1, errors
    assert errors[0].startswith(f"error: --dry-run={spec}") and expected in errors[0]
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_and_keeps_the_earlier_definition(small_disk, capsys, no_network):
    """The definition (~20 KB) does not fit on a 4 KiB file system: one line, the earlier one kept, no part."""
    disk = small_disk(4)
    earlier = json.dumps({"entity": "e", "project": "p", "displayName": "old", "spec": {"section": {}}})
    (disk / "workspace.json").write_text(earlier)
    code, printed, errors = dashboard(capsys, "--dry-run", str(disk / "workspace.json"))
    assert code in (1, 2) and printed == [] and len(errors) == 1 and errors[0].startswith("error: "), errors
    assert sorted(p.name for p in disk.iterdir()) == ["workspace.json"]
    assert (disk / "workspace.json").read_text() == earlier


# ----------------------------------------------------------------------------------------- WANDB_MODE
@pytest.mark.parametrize(
    ("env", "mode", "key", "expected"),
    [
        ("disabled", "auto", True, "disabled"),
        ("disabled", "online", True, "disabled"),  # W&B's switch for everything wins over the config
        ("offline", "auto", True, "offline"),
        ("dryrun", "auto", True, "offline"),
        ("offline", "online", False, "online"),  # an explicit logger.mode wins over the environment's online/offline
        ("", "auto", True, "online"),
        ("", "auto", False, "offline"),
    ],
)
def test_the_wandb_mode_follows_wandb_mode_then_the_config(monkeypatch, env, mode, key, expected):
    from lychee_exp.config.schema import LoggerConfig
    from lychee_exp.tracking import backends

    monkeypatch.setenv("WANDB_MODE", env)
    monkeypatch.setattr(backends, "has_wandb_api_key", lambda: key)
    assert backends.wandb_mode(LoggerConfig(mode=mode)) == expected


def test_wandb_mode_disabled_writes_no_wandb_directory(tmp_path, monkeypatch):
    """A real run with logger=wandb and WANDB_MODE=disabled: trained and measured, metrics.csv kept, and nothing of
    W&B written anywhere (before: an offline run in <run>/wandb)."""
    from conftest import TINY_OVERRIDES, run_cli

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    overrides = [*TINY_OVERRIDES, "trainer.max_steps=2", "trainer.save_model=false", "logger=wandb"]
    proc = run_cli(overrides, tmp_path / "run")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "run" / "metrics.json").is_file() and (tmp_path / "run" / "metrics.csv").is_file()
    assert [str(p) for p in tmp_path.rglob("*wandb*")] == []
