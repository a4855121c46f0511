"""The local report (python -m lychee_exp.report): built from hand-written run directories, read back with
html.parser (and, marked slow, loaded in headless Chromium); its --out by the output policy (a path naming no
file, a full disk: one line, nothing written) and Ctrl-C / SIGTERM (one line, 130 / 143, the earlier page kept)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from lychee_exp.tracking.report.data import best_trial, find
from lychee_exp.tracking.report.html import build, headless_chromium, main
from lychee_exp.tracking.report.output import GENERATOR_TAG

CHROMIUM = Path("/usr/bin/chromium")


class Tables(HTMLParser):
    """Every <table>: its attributes and its rows as lists of cell texts; plus counts of other tags."""

    def __init__(self):
        super().__init__()
        self.tables: list[dict] = []
        self.tags: dict[str, int] = {}
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag == "table":
            self.tables.append({"attrs": dict(attrs), "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1]["rows"][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def find(self, *, id: str | None = None, cls: str | None = None) -> list[dict]:
        return [
            t for t in self.tables if (id and t["attrs"].get("id") == id) or (cls and t["attrs"].get("class") == cls)
        ]


def parse(text: str) -> Tables:
    parser = Tables()
    parser.feed(text)
    return parser


def as_dicts(table: dict) -> list[dict[str, str]]:
    header, *rows = table["rows"]
    return [dict(zip(header, row)) for row in rows]


def write_run(run_dir: Path, metrics: dict, history: list[dict] | None = None, config: dict | None = None) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    if history:
        columns = list(dict.fromkeys(k for row in history for k in row))
        with (run_dir / "metrics.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(history)
    if config:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def write_csv(path: Path, rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)


FULL = {  # a run that mixes the teacher into its dev ranking: the model's own figures are model_*
    "model_ndcg@10": 0.55,
    "model_mrr@10": 0.5,
    "initial_model_ndcg@10": 0.42,
    "mix": "the teacher at 0.7",
    "ndcg@10": 0.65,
    "mrr@10": 0.6,
    "initial_ndcg@10": 0.5,
    "initial_mrr@10": 0.45,
    "train_loss": 0.3,
    "steps": 20,
    "effective_batch_size": 16,
    "per_device_batch_size": 8,
    "num_devices": 2,
    "grad_accum_steps": 1,
    "lr": 2e-4,
    "base_lr": 1e-4,
    "precision": "fp32",
    "device": "cpu",
    "train_samples_per_s": 41.5,
    "train_tokens_per_s": 9000,
    "data_wait_share": 0.12,
    "rank_time_spread": 1.1,
    "peak_memory_mb_per_rank": [1024, 2048],
    "train_time_s": 12.5,
    "eval_time_s": 1.5,
    "speedup": 1.85,
    "scaling_efficiency": 0.93,
    "baseline_samples_per_s": 22.4,
    "device_type": "cpu",
    "strategy": "ddp",
    "stopped_early": True,
}


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "outputs"
    history = [
        {"step": 0, "dev/ndcg@10": 0.5, "dev/mrr@10": 0.45},
        {"step": 5, "train/loss": 0.6, "train/lr": 1e-4, "train/samples_per_s": 40, "epoch": 0},
        {"step": 10, "train/loss": 0.4, "train/lr": 1e-4, "train/samples_per_s": 42, "epoch": 0},
        {"step": 10, "dev/ndcg@10": 0.65, "dev/mrr@10": 0.6},
    ]
    write_run(
        root / "runs" / "ddp2",
        FULL,
        history,
        {
            "model": {"name": "tiny_lychee"},
            "loss": {"name": "pointwise"},
            "optimizer": {"lr": 1e-4},
            "data": {"batch_size": 8},
        },
    )
    write_run(root / "runs" / "old", {"ndcg@10": 0.4, "world_size": 1})  # an older run: most keys missing
    for n, (lr, ndcg) in enumerate([(1e-4, 0.55), (3e-4, 0.7)]):
        write_run(
            root / "sweep" / str(n),
            {
                **FULL,
                "ndcg@10": ndcg,
                "lr": lr,
                "base_lr": lr,
                "num_devices": 1,
                "speedup": 1.0,
                "scaling_efficiency": 1.0,
            },
            history,
        )
    _sweeper_writes_results(root / "sweep")
    write_csv(
        root / "bench" / "bench.csv",
        [
            ["devices", "samples_per_s", "speedup", "efficiency", "data_wait_share", "rank_time_spread"],
            [1, 20.0, 1.0, 1.0, 0.1, 1.0],
            [2, 36.0, 1.8, 0.9, 0.12, 1.05],
        ],
    )
    return root


def _sweeper_writes_results(sweep_dir: Path) -> None:
    """trials.csv and optimization_results.yaml as the sweeper writes them (its own writer, from an Optuna study
    of two complete trials and one failed), not a header typed here."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    from lychee_exp.sweep.storage import METRICS, REASON
    from lychee_exp.sweep.sweep_results import write_sweep_results

    study = optuna.create_study(study_name="s1", direction="maximize")
    lr = {"optimizer.lr": FloatDistribution(1e-5, 1e-2, log=True)}
    facts = {"per_device_batch_size": 8, "effective_batch_size": 8, "speedup": 1.0, "scaling_efficiency": 1.0}
    for lr_value, value in [(1e-4, 0.55), (3e-4, 0.7)]:
        study.add_trial(
            create_trial(params={"optimizer.lr": lr_value}, distributions=lr, value=value, user_attrs={METRICS: facts})
        )
    study.add_trial(
        create_trial(
            state=TrialState.FAIL, params={"optimizer.lr": 1e-3}, distributions=lr, user_attrs={REASON: "loss is NaN"}
        )
    )
    write_sweep_results(study, sweep_dir, 3, "ndcg@10", "sqlite:///:memory:", plots=False)


def test_report_tables_hold_the_runs(root, tmp_path):
    out = build(root, tmp_path / "report.html")
    page = parse(out.read_text())

    (runs,) = page.find(id="runs")
    rows = {row["run"]: row for row in as_dicts(runs)}
    assert list(rows) == ["runs/ddp2", "runs/old", "sweep/0", "sweep/1"]
    ddp = rows["runs/ddp2"]
    assert ddp["model / loss"] == "tiny_lychee / pointwise"
    assert ddp["world size"] == "2" and ddp["effective batch"] == "16"
    assert ddp["lr (base → scaled)"] == "1.00e-04 → 2.00e-04"
    # the model's own figures lead, the mix beside them, named
    assert ddp["model ndcg@10 (gain)"] == "0.550 (+0.130)" and ddp["model mrr@10"] == "0.500"
    assert ddp["mix ndcg@10"] == "0.650" and ddp["mixed with"] == "the teacher at 0.7"
    assert ddp["speedup"] == "1.85" and ddp["efficiency"] == "93%"
    assert ddp["samples/s"] == "41.50" and ddp["peak memory (MB)"] == "2,048"  # the busiest rank
    old = rows["runs/old"]
    # written before model_* was logged for every run: unmixed, so its ndcg@10 is the model's; no mix
    assert old["model ndcg@10 (gain)"] == "0.400" and old["world size"] == "1" and old["mix ndcg@10"] == "—"
    assert {old[k] for k in ("model / loss", "speedup", "efficiency", "samples/s", "peak memory (MB)")} == {"—"}

    (sweep,) = page.find(cls="sweep")
    trials = as_dicts(sweep)
    assert [t["number"] for t in trials] == ["0", "1", "2"]
    assert trials[2]["state"] == "FAIL" and trials[2]["reason"] == "loss is NaN" and trials[2]["metric"] == "—"
    assert "Best trial 1" in out.read_text() and "optimizer.lr = 0.0003" in out.read_text()

    (bench,) = page.find(cls="bench")
    assert [(b["devices"], b["speedup"], b["efficiency"]) for b in as_dicts(bench)] == [
        ("1", "1", "1"),
        ("2", "1.8", "0.9"),
    ]
    (throughput,) = page.find(id="throughput")
    first = as_dicts(throughput)[0]
    assert first["peak memory per rank (MB)"] == "1,024, 2,048" and first["steps"] == "20 (stopped early)"
    assert first["device"] == "cpu · ddp" and first["data wait"] == "12%"

    # self-contained: figures are inline SVG, nothing is fetched
    text = out.read_text()
    assert page.tags.get("svg", 0) >= 6  # scaling, bench, hyperparameters, 2 loss-curve groups, bars
    assert "<script" not in text and "<link" not in text and "src=" not in text
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_best_trial_without_optimization_results(root):
    (root / "sweep" / "optimization_results.yaml").unlink()
    (sweep,) = find(root).sweeps
    assert best_trial(sweep) == {
        "trial": "1",
        "value": 0.7,
        "params": {"lr": "0.0003", "per_device_batch_size": "8", "effective_batch_size": "8"},
    }


def report_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lychee_exp.tracking.report.html", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_prints_the_output_path(root):
    proc = report_cli(str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(root / "report.html")
    assert (root / "report.html").is_file()


@pytest.mark.parametrize("make", [lambda tmp: tmp / "missing", lambda tmp: tmp])
def test_no_runs_is_one_line_error(tmp_path, make):
    proc = report_cli(str(make(tmp_path)))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "report.html").exists()


@pytest.mark.slow
def test_report_renders_in_headless_chromium(root, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is absent (Debian: apt-get install -y chromium; .ci/run installs it)")
    out = build(root, tmp_path / "report.html")
    proc = headless_chromium(out, "--dump-dom", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = parse(proc.stdout)
    assert len(dom.find(id="runs")) == 1 and len(dom.find(id="throughput")) == 1
    assert len(dom.find(cls="sweep")) == 1 and len(dom.find(cls="bench")) == 1
    assert len(as_dicts(dom.find(id="runs")[0])) == 4
    assert dom.tags.get("svg", 0) >= 6


# ------------------------------------------------------------------------- --out by the output policy, stopping
def report_main(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    """`python -m lychee_exp.report <args>` in this process: exit status, stdout lines, stderr lines."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.splitlines(), [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def one_run(tmp_path) -> Path:
    write_run(tmp_path / "runs" / "r1", {"ndcg@10": 0.5})
    return tmp_path / "runs"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("{t}/pages/", "ends with '/', but this command writes a file"),  # not a file named `pages`
        ("", "--out= is empty"),  # not the default <dir>/report.html
        ("pkg://lychee_exp.assets/report.html", "an output is a local path"),  # not ./pkg:/lychee_exp.assets/...
        ("{t}/" + "p" * 300 + ".html", ""),  # a name longer than a file system takes (255 bytes)
    ],
    ids=["trailing-slash", "empty", "pkg", "name-too-long"],
)
def test_an_out_that_names_no_file_is_one_line_and_writes_nothing(one_run, tmp_path, capsys, spec, expected):
    from test_bench_outputs import tree

    spec = spec.format(t=tmp_path)
    before = tree(tmp_path)
    code, printed, errors = report_main(capsys, str(one_run), "--out", spec)
    assert code == 2 and printed == [] and len(errors) == 1, errors
    assert errors[0].startswith(f"error: --out={spec}") and expected in errors[0], errors
    assert tree(tmp_path) == before


def test_a_full_disk_is_one_line_and_keeps_the_earlier_page(one_run, small_disk, capsys):
    """The page (~25 KB) does not fit on an 8 KiB file system that holds an earlier page of ours: one line, the
    earlier page byte for byte, no half-written page or temporary beside it."""
    from test_bench_outputs import tree

    disk = small_disk(8)
    earlier = f"<!DOCTYPE html><html><head>{GENERATOR_TAG}</head><body>earlier</body></html>"
    (disk / "report.html").write_text(earlier)
    code, printed, errors = report_main(capsys, str(one_run), "--out", str(disk / "report.html"))
    assert code in (1, 2) and printed == [] and len(errors) == 1 and errors[0].startswith("error: "), errors
    assert tree(disk) == {"report.html": earlier.encode()}


@pytest.mark.parametrize(
    ("sig", "code", "words"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stopped_report_is_one_line_and_keeps_the_earlier_page(one_run, tmp_path, sig, code, words):
    """Stopped while it reads the runs: a metrics.json that is a FIFO holds the report in its read until the signal
    comes (the report has opened it: a writer can open the FIFO only then). One line, the shell's exit status, no
    traceback, the earlier page byte for byte."""
    from test_bench_outputs import interrupt

    page = build(one_run, tmp_path / "page.html").read_bytes()
    fifo = one_run / "r2" / "metrics.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    writer: list[int] = []

    def reading(printed: str, pid: int) -> bool:
        try:
            writer.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO until a reader has it open
        except OSError:
            return False
        return True

    try:
        cmd = [sys.executable, "-m", "lychee_exp.report", str(one_run), "--out", str(tmp_path / "page.html")]
        status, output = interrupt(cmd, reading, sig, cwd=tmp_path)
    finally:
        for fd in writer:
            os.close(fd)
    assert status == code and output == f"{words}; {tmp_path / 'page.html'} left as it was\n", output
    assert (tmp_path / "page.html").read_bytes() == page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html", "runs"]  # no staging, no lock


@pytest.mark.parametrize("name", ["config.json", "page.html"])
def test_overwrite_never_reaches_inside_a_model_directory(tmp_path, capsys, name):
    """`--out <run>/model/config.json --overwrite` (a file the report does not read) or a new file there: refused in
    one line, the model byte for byte. --overwrite replaces a file, never part of a model (docs/outputs.md)."""
    from test_bench_outputs import tree

    run = tmp_path / "runs" / "r1"
    write_run(run, {"ndcg@10": 0.5}, config={"seed": 1})
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64}\n')
    (run / "model" / "model.safetensors").write_bytes(b"weights")
    before = tree(tmp_path)
    target = run / "model" / name
    code, printed, errors = report_main(capsys, str(tmp_path / "runs"), "--out", str(target), "--overwrite")
    assert code == 2 and printed == [] and len(errors) == 1 and errors[0].startswith(f"error: --out={target}"), errors
    assert tree(tmp_path) == before
