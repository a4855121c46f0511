"""The seed guide's monitoring: a DDP run's offline W&B record, and TensorBoard event files on rank 0 with W&B's
key names, read back with TensorBoard's own reader (one 2-rank run, shared); rank 0's GPU memory and utilisation in
the step line, W&B and TensorBoard."""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from baselines import seed_baseline
from conftest import REPO_ROOT, TINY_RANKS
from omegaconf import OmegaConf

from lychee_exp.config.schema import RunConfig
from lychee_exp.job.in_process import run_job
from lychee_exp.tracking.keys import HISTORY
from lychee_exp.tracking.wandb_records import find_run_files, read_run

# the tiny DDP settings with per-step rows and dev evaluations at 0, 2, 4; the test caches a one-device figure, so
# that the speedup is one whatever the machine's load
TINY = [
    *(o for o in TINY_RANKS if not o.startswith("logger=")),
    "data.batch_size=2",
    "trainer.eval_every=2",
]
# the keys the seed guide watches: loss, lr, dev metrics (history); effective batch size, speedup (summary)
HISTORY_KEYS = [HISTORY["loss"], HISTORY["lr"], HISTORY["dev_ndcg"], HISTORY["dev_mrr"]]
SUMMARY_KEYS = ["effective_batch_size", "speedup"]


def _scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """One 2-rank job with W&B (offline: no key anywhere) and TensorBoard, read by the tests of both loggers."""
    tmp = tmp_path_factory.mktemp("ddp_loggers")
    run_dir = tmp / "run"
    overrides = [*TINY, "parallel=ddp", "gpus=2", "logger=wandb", "logger.tensorboard=true", "logger.tags=[smoke]"]
    overrides += ["optimizer.lr=1e-3"]
    with pytest.MonkeyPatch.context() as env:  # as the no_wandb_key fixture, for the module
        env.delenv("WANDB_API_KEY", raising=False)
        env.delenv("WANDB_MODE", raising=False)
        env.setenv("HOME", str(tmp / "home"))
        env.setenv("WANDB_CONFIG_DIR", str(tmp / "wandb-config"))
        env.setenv("LYCHEE_BASELINE_FILE", str(tmp / "baselines.json"))
        seed_baseline(overrides, run_dir, 1000.0)  # a cached one-device figure: a speedup whatever the load
        run_job(overrides, run_dir)
    return run_dir


def _rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_ddp_run_writes_one_offline_wandb_run_matching_metrics(ddp_run):
    run_dir = ddp_run
    files = find_run_files(run_dir)
    assert len(files) == 1 and "offline-run" in str(files[0])
    record, metrics = read_run(files[0]), json.loads((run_dir / "metrics.json").read_text())
    assert record["summary"]["effective_batch_size"] == metrics["effective_batch_size"] == 4
    assert record["summary"]["speedup"] == pytest.approx(metrics["speedup"])
    assert record["summary"]["num_devices"] == 2
    # the summary keeps the best dev figure: every evaluation (steps 0, 2, 4 here) counts
    dev = [float(r[HISTORY["dev_ndcg"]]) for r in _rows(run_dir) if r.get(HISTORY["dev_ndcg"])]
    assert dev[0] == pytest.approx(metrics["initial_ndcg@10"]) and dev[-1] == pytest.approx(metrics["ndcg@10"])
    assert record["summary"]["dev/ndcg@10"]["max"] == pytest.approx(max(dev))
    config = record["config"]
    assert config["num_devices"] == 2 and config["effective_batch_size"] == 4 and config["grad_accum_steps"] == 1
    assert config["optimizer"]["lr"] == pytest.approx(1e-3) and config["lr"] == pytest.approx(metrics["lr"])
    assert record["run"]["job_type"] == "train" and record["run"]["group"] == run_dir.name
    assert record["run"]["tags"] == ["smoke"]
    assert [row["train/loss"] for row in record["history"] if "train/loss" in row]  # per-step history


def test_tensorboard_beside_wandb_on_rank_0_with_the_same_keys(ddp_run):
    run_dir = ddp_run
    assert len(list(run_dir.glob("**/events.out.tfevents.*"))) == 1  # one writer: rank 0's
    scalars = _scalars(run_dir / "tensorboard")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rows = _rows(run_dir)
    for key in HISTORY_KEYS:
        logged = {int(r["step"]): float(r[key]) for r in rows if r.get(key)}
        assert logged and scalars[key].keys() == logged.keys(), key
        assert list(scalars[key].values()) == pytest.approx(list(logged.values()), rel=1e-6), key
    assert sorted(scalars[HISTORY["loss"]]) == [1, 2, 3, 4] and sorted(scalars[HISTORY["dev_ndcg"]]) == [0, 2, 4]
    for key in SUMMARY_KEYS:
        assert scalars[key] == {4: pytest.approx(metrics[key], rel=1e-6)}, key
    assert metrics["effective_batch_size"] == 4 and metrics["speedup"] > 0
    # W&B got the same names: its history keys are the event files' history tags
    (wandb_file,) = find_run_files(run_dir)
    record = read_run(wandb_file)
    wandb_history = {k for row in record["history"] for k in row if not k.startswith("_")}
    tb_history = {k for k, by_step in scalars.items() if len(by_step) > 1 or k.startswith(("train/", "dev/"))}
    assert tb_history == wandb_history
    for key in SUMMARY_KEYS:
        assert record["summary"][key] == pytest.approx(scalars[key][4], rel=1e-6)


def test_logger_tensorboard_alone_writes_events_and_csv_only(tmp_path):
    run_dir = tmp_path / "run"
    run_job([*TINY, "parallel=single", "logger=tensorboard", "trainer.max_steps=2"], run_dir)
    assert not (run_dir / "wandb").exists() and (run_dir / "metrics.csv").is_file()
    scalars = _scalars(run_dir / "tensorboard")
    assert all(key in scalars for key in [*HISTORY_KEYS, *SUMMARY_KEYS])


def test_gpu_memory_goes_to_the_step_line_and_every_logger(monkeypatch, caplog):
    """The plumbing, with torch.cuda's figures faked (no GPU here): what gpu_memory reads reaches the step's log
    line and the logger row under HISTORY's keys; NVML missing leaves utilisation out instead of failing."""
    from lychee_exp.tracking import throughput
    from lychee_exp.tracking.console import log_train_step
    from lychee_exp.train.progress import StepFigures

    mb = 2**20
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 100 * mb)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 160 * mb)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 120 * mb)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 200 * mb)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 87)
    monkeypatch.setattr(throughput, "_nvml_missing", False)
    gpu = throughput.gpu_memory(torch.device("cuda", 0))
    assert gpu == {
        HISTORY["gpu_memory_allocated"]: 100,
        HISTORY["gpu_memory_reserved"]: 160,
        HISTORY["gpu_peak_allocated"]: 120,
        HISTORY["gpu_peak_reserved"]: 200,
        HISTORY["gpu_utilization"]: 87,
    }

    class Rows:
        rows: list = []

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics))

    figures = StepFigures(**dict.fromkeys(StepFigures.__dataclass_fields__, 1.0))
    logger = Rows()
    with caplog.at_level(logging.INFO, logger="lychee_exp.tracking.console"):
        log_train_step(logger, True, 3, 4, 0, 0.5, 1e-3, figures, gpu)
    assert "gpu mem 100/160 MB (peak 120/200) | util 87%" in caplog.text
    assert logger.rows[0][0] == 3 and logger.rows[0][1].items() >= gpu.items()

    def no_nvml(device):
        raise ModuleNotFoundError("No module named 'pynvml'")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    monkeypatch.setattr(throughput, "_nvml_missing", False)
    assert HISTORY["gpu_utilization"] not in throughput.gpu_memory(torch.device("cuda", 0))
    assert throughput.gpu_memory(torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_run_logs_its_memory_to_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    run_job([*TINY, "parallel=single", "gpus=1", "logger=tensorboard"], run_dir)
    scalars = _scalars(run_dir / "tensorboard")
    allocated, reserved = scalars[HISTORY["gpu_memory_allocated"]], scalars[HISTORY["gpu_memory_reserved"]]
    assert sorted(allocated) == [1, 2, 3, 4] and all(0 < allocated[s] <= reserved[s] for s in allocated)
    peak = scalars[HISTORY["gpu_peak_allocated"]]
    assert all(peak[s] >= allocated[s] for s in allocated)


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path):
    """A resumed run truncates its loggers at the checkpoint's step, then logs the later steps again: TensorBoard
    must show the second values only (purge_step), as metrics.csv does."""
    from lychee_exp.tracking.backends import TensorBoardLogger

    first = TensorBoardLogger(tmp_path, {})
    for step in range(1, 5):
        first.log_metrics({HISTORY["loss"]: float(step)}, step)
    first.finish()  # the run died after step 4; its last checkpoint is step 2
    resumed = TensorBoardLogger(tmp_path, {})
    resumed.truncate(2)
    for step in (3, 4):
        resumed.log_metrics({HISTORY["loss"]: 10.0 * step}, step)
    resumed.finish()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars(HISTORY["loss"])] == [(1, 1), (2, 2), (3, 30), (4, 40)]


def test_metrics_csv_is_replaced_whole_and_a_failed_write_keeps_the_last_table(tmp_path, monkeypatch):
    """metrics.csv is rewritten at every logged step (its columns grow): each version whole (io.atomic), so a run
    killed or out of disk mid-write keeps the previous table, which its resume reads back."""
    import os

    from lychee_exp.tracking.backends import CSVLogger

    logger = CSVLogger(tmp_path)
    logger.log_metrics({HISTORY["loss"]: 1.0}, 1)
    logger.log_metrics({HISTORY["loss"]: 0.5, HISTORY["dev_ndcg"]: 0.3}, 2)
    table = (tmp_path / "metrics.csv").read_bytes()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        logger.log_metrics({HISTORY["loss"]: 0.25}, 3)
    monkeypatch.undo()
    assert (tmp_path / "metrics.csv").read_bytes() == table and sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.csv"
    ]
    resumed = CSVLogger(tmp_path)
    resumed.truncate(1)
    resumed.log_metrics({HISTORY["loss"]: 0.75}, 2)
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r[HISTORY["loss"]]) for r in rows] == [("1", "1.0"), ("2", "0.75")]


def _listed(text: str, after: str, before: str) -> set[str]:
    """The plain key names in backticks between two phrases of a paragraph."""
    part = text[text.index(after) + len(after) :]
    return set(re.findall(r"`([a-z_/@0-9]+)`", part[: part.index(before)]))


def test_the_wandb_keys_docs_reporting_md_lists_are_what_a_run_logs(ddp_run):
    """docs/reporting.md's W&B paragraph names the config's additions, the per-step, per-evaluation and summary
    keys: each is in the run's record, and every key the run adds to its resolved config is named."""
    text = (REPO_ROOT / "docs" / "reporting.md").read_text()
    text = " ".join(text[text.index("**W&B** (`logger=wandb`") :].split())
    text = text[: text.index("checks these lists")]
    record = read_run(find_run_files(ddp_run)[0])
    config = _listed(text, "The run's config is", "; a sweep's trial adds")
    added = set(record["config"]) - set(OmegaConf.to_container(OmegaConf.structured(RunConfig))) - {"_wandb"}
    assert config == added
    history = set().union(*record["history"])
    assert _listed(text, "Logged per step:", "(GPU runs") <= history
    assert _listed(text, "per evaluation", "([the model") <= history
    summary = _listed(text, "summary keeps the best); summary:", "final metrics")
    assert summary | {"model_ndcg@10", "ndcg@10", "model_mrr@10", "mrr@10"} <= set(record["summary"])
