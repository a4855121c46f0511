"""The output policy's escape hatches (issue 51): what overwrite=true may replace, a continued run that changes
nothing until its checks passed, a restarted job let in by its own run's state (not by the environment), -m jobs
that never reuse an earlier sweep's directories, outputs that never reach inside a model, dataset or run, full
disks and over-long names as one line, stop signals (SIGHUP, SIGQUIT) handled as SIGTERM, and locks that go.

What wrong code would still pass, beside each guard: see the comments."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from beir_helpers import fruit_dataset
from conftest import TINY_OVERRIDES, output_lines, run_cli, run_metrics
from ddp_helpers import live_processes_in_group
from omegaconf import OmegaConf
from test_user_files import _command, _run, _user_files

from lychee_exp import mine as mine_entry
from lychee_exp import rerank as rerank_entry
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import update_json_locked
from lychee_exp.io.outputs import RUN_MARKER, resolved, staged_output
from lychee_exp.job import run_dir
from lychee_exp.job.run_dir import (
    KEPT,
    RunAlreadyFinished,
    RunDirGuard,
    RunDirRefused,
    claim_run_dir,
    commit_run_dir,
    finish_run_dir,
    release_sweep_dir,
)

FAST = [*TINY_OVERRIDES, "trainer.max_steps=2", "trainer.eval_before_training=false"]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _project(path: Path) -> Path:
    """A user's folder that is not a run: sources and a thesis."""
    (path / "src").mkdir(parents=True)
    (path / "src" / "main.py").write_text("print('mine')\n")
    (path / "thesis.tex").write_text("\\documentclass{article}\n")
    return path


def _run_dir(path: Path, job: str | None = None, checkpoint: bool = False, finished: bool = True) -> Path:
    """What a run of this lychee_exp leaves (the guard reads names and the marker only)."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text("seed: 1\n")
    (path / RUN_MARKER).write_text(json.dumps({"what": "a lychee_exp training run", "job": job}) + "\n")
    (path / "run.log").write_text("the earlier run's log\n")
    (path / "config.yaml").write_text("model:\n  path: pkg://lychee_exp.assets/tiny_qwen2\n  kind: causal_lm\n")
    if finished:
        (path / "metrics.json").write_text('{"ndcg@10": 0.5}\n')
        (path / "model").mkdir()
        (path / "model" / "model.safetensors").write_bytes(b"weights")
    if checkpoint:
        (path / "checkpoints" / "step_000002").mkdir(parents=True)
    return path


@pytest.fixture(autouse=True)
def _no_claim_left():
    yield
    finish_run_dir(False)
    release_sweep_dir()


# ------------------------------------------------------------------------------------------ what overwrite replaces
def test_overwrite_in_a_project_as_the_issue_ran_it_is_one_line_and_loses_nothing(tmp_path):
    """`cd myproj && python -m lychee_exp.run hydra.run.dir=. overwrite=true` moved the project aside and deleted
    it. (A guard that only refuses the cwd would still let hydra.run.dir=<a docs folder> overwrite=true through:
    the next test.)"""
    project = _project(tmp_path / "myproj")
    before = _files(project)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", *FAST, "hydra.run.dir=.", "overwrite=true"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = output_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "holds files that are not a lychee_exp run (src, thesis.tex)" in lines[0]
    assert "overwrite=true" not in lines[0]  # the refusal no longer invites the flag that would delete them
    assert _files(project) == before and sorted(p.name for p in tmp_path.iterdir()) == ["myproj"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_is_not_a_run_is_never_a_run_directory(tmp_path, overwrite):
    docs = _project(tmp_path / "mydocs")
    before = _files(docs)
    with pytest.raises(UserError, match=r"mydocs holds files that are not a lychee_exp run \(src, thesis.tex\)"):
        claim_run_dir(str(docs), resume="never", overwrite=overwrite, inputs=[])
    assert _files(docs) == before and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("cwd", "is the current directory"),
        ("ancestor", "is a directory that holds the current one"),
        ("home", "is the home directory"),
    ],
)
def test_overwrite_never_replaces_the_ground_the_user_stands_on(tmp_path, monkeypatch, where, expected):
    """Even a real run is not replaced where it is the cwd, holds it, or is $HOME: moving it aside would leave the
    user's shell in a deleted directory (wrong code: checking only for foreign files, which a run has none of)."""
    run = _run_dir(tmp_path / "run")
    (run / "logs").mkdir()
    monkeypatch.chdir(run if where == "cwd" else run / "logs" if where == "ancestor" else tmp_path)
    monkeypatch.setenv("HOME", str(run if where == "home" else tmp_path / "elsewhere"))
    before = _files(run)
    with pytest.raises(UserError, match=expected):
        claim_run_dir(str(run), resume="never", overwrite=True, inputs=[])
    assert _files(run) == before


def test_overwrite_replaces_only_a_run_that_carries_the_marker_and_nothing_foreign(tmp_path):
    legacy = _run_dir(tmp_path / "legacy")
    (legacy / RUN_MARKER).unlink()  # a run of an earlier lychee_exp, or another Hydra app's job
    with pytest.raises(UserError, match=r"legacy has no \.lychee_run\.json .* overwrite=true replaces only"):
        claim_run_dir(str(legacy), resume="never", overwrite=True, inputs=[])
    noted = _run_dir(tmp_path / "noted")
    (noted / "notes.md").write_text("what I found\n")
    with pytest.raises(UserError, match=r"holds files a run does not write \(notes.md\): not replaced"):
        claim_run_dir(str(noted), resume="never", overwrite=True, inputs=[])
    assert (noted / "notes.md").read_text() == "what I found\n"
    run = _run_dir(tmp_path / "run")
    claim_run_dir(str(run), resume="never", overwrite=True, inputs=[])  # a plain run: set aside until the new ends
    assert not run.exists() and len(list(tmp_path.glob(".run.*.replaced-*"))) == 1


def test_a_legacy_run_without_the_marker_can_still_be_continued_and_then_carries_it(tmp_path):
    run = _run_dir(tmp_path / "run", checkpoint=True)
    (run / RUN_MARKER).unlink()
    claim_run_dir(str(run), resume="auto", overwrite=False, inputs=[])
    assert not (run / RUN_MARKER).exists()  # nothing changes before the checks have passed
    commit_run_dir(run)
    assert json.loads((run / RUN_MARKER).read_text())["what"] == "a lychee_exp training run"


# ---------------------------------------------------------------------------- a continued run changes after checks
def _finished_cli_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    proc = run_cli([*FAST, "trainer.checkpoint_every=1"], run)
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.mark.slow
def test_a_resume_that_fails_its_checks_leaves_the_run_byte_for_byte(tmp_path):
    """A missing dev file, a misspelt loss, another model, and a resume with nothing left to train: the run's
    files (its .hydra/, log, config, metrics.json, model/, checkpoints) stay byte for byte. Wrong code that only
    keeps metrics.json would fail on .hydra/ and run.log; wrong code that restores nothing would lose metrics.json."""
    run = _finished_cli_run(tmp_path)
    before = _files(run)
    resume = [*FAST, "trainer.checkpoint_every=1", "trainer.resume=auto"]
    for extra, code, said in [
        (["data.dev_file=/nonexistent/dev.jsonl"], 2, "data.dev_file=/nonexistent/dev.jsonl: /nonexistent/dev.jsonl"),
        (["loss.name=pairwise"], 2, "loss.name='pairwise' is not one of"),
        (["model.lora.enabled=true"], 2, "trained model.lora.enabled=False, this run has model.lora.enabled=True"),
    ]:
        proc = run_cli([*resume, *extra], run)
        errors = [line for line in output_lines(proc) if "error:" in line]
        assert proc.returncode == code and len(errors) == 1 and said in errors[0], proc.stderr
        assert _files(run) == before, extra
    proc = run_cli(resume, run)
    assert proc.returncode == 0 and "nothing left to train" in proc.stdout + proc.stderr, proc.stderr
    after = _files(run)
    assert after["metrics.json"] == before["metrics.json"]  # not rewritten with zero throughput
    assert {k: v for k, v in after.items() if k.startswith(("model/", "checkpoints/"))} == {
        k: v for k, v in before.items() if k.startswith(("model/", "checkpoints/"))
    }
    assert not list(tmp_path.glob(f".*{KEPT}-*"))


def test_ctrl_c_during_a_resumes_checks_puts_back_what_hydra_changed(tmp_path, monkeypatch, capsys):
    """The run as Hydra leaves it once the claim let it in (.hydra/ rewritten, a line appended to run.log): Ctrl-C
    before the checks passed gives back both; a command killed then (SIGKILL) gets them back at the next claim."""
    run = _run_dir(tmp_path / "run", checkpoint=True)
    before = _files(run)

    def hydra_writes(target: Path) -> None:
        (target / ".hydra" / "config.yaml").write_text("seed: 2\n")
        (target / ".hydra" / "overrides.yaml").write_text("- trainer.resume=auto\n")
        with (target / "run.log").open("a") as handle:
            handle.write("the resumed attempt's first line\n")

    claim_run_dir(str(run), resume="auto", overwrite=False, inputs=[])
    hydra_writes(run)
    finish_run_dir(False)  # run.main's finally after KeyboardInterrupt, before commit
    assert _files(run) == before and not list(tmp_path.glob(".*"))

    claim_run_dir(str(run), resume="auto", overwrite=False, inputs=[])
    hydra_writes(run)
    kept = next(tmp_path.glob(f".*.{KEPT}-*"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    kept.rename(kept.with_name(kept.name.replace(f"{KEPT}-{os.getpid()}-", f"{KEPT}-{dead.pid}-")))
    run_dir._claim.kept = None  # as if this process had been SIGKILLed: no finally ran
    run_dir._claim.lock.release()
    run_dir._claim = None
    claim_run_dir(str(run), resume="auto", overwrite=False, inputs=[])
    assert _files(run) == before  # put back by the next claim, which holds the lock


def test_a_resume_that_passed_its_checks_keeps_hydras_new_files(tmp_path):
    run = _run_dir(tmp_path / "run", checkpoint=True)
    claim_run_dir(str(run), resume="auto", overwrite=False, inputs=[])
    (run / ".hydra" / "config.yaml").write_text("seed: 2\n")
    commit_run_dir(run)
    finish_run_dir(False)  # the training failed later: the run is continued from here, as it is
    assert (run / ".hydra" / "config.yaml").read_text() == "seed: 2\n" and not list(tmp_path.glob(".*"))


# ------------------------------------------------------------------------------------------------ restarted jobs
@pytest.mark.parametrize("var", ["SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"])
def test_a_restart_is_let_in_by_its_own_runs_state_not_by_the_environment(tmp_path, monkeypatch, var):
    """The old guard let any restarted job overwrite a finished run (every step of a requeued job). Now: another
    job's run is refused; this job's finished run is left as it was (exit 0 upstream); its unfinished run is
    continued."""
    job_var = "SLURM_JOB_ID" if var.startswith("SLURM") else "TORCHELASTIC_RUN_ID"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv(var, "1")
    monkeypatch.setenv(job_var, "4242")
    other = _run_dir(tmp_path / "other", job=f"{job_var}=17")
    before = _files(other)
    with pytest.raises(UserError, match="already holds a run"):
        claim_run_dir(str(other), resume="never", overwrite=False, inputs=[], restarted=True)
    assert _files(other) == before
    own = f"{job_var}=4242"
    done = _run_dir(tmp_path / "done", job=own)
    before = _files(done)
    with pytest.raises(RunAlreadyFinished, match="finished the run before it was restarted; left as it was"):
        claim_run_dir(str(done), resume="never", overwrite=False, inputs=[], restarted=True)
    assert _files(done) == before
    going = _run_dir(tmp_path / "going", job=own, checkpoint=True, finished=False)
    assert claim_run_dir(str(going), resume="never", overwrite=False, inputs=[], restarted=True) is True


def test_the_guard_resumes_a_restarted_jobs_own_run_from_its_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setattr(run_dir, "is_main_process", lambda: True)
    going = _run_dir(tmp_path / "going", job="SLURM_JOB_ID=99", checkpoint=True, finished=False)
    config = OmegaConf.create({"hydra": {"run": {"dir": str(going)}}, "trainer": {"resume": "never"}})
    RunDirGuard().on_run_start(config)
    assert config.trainer.resume == "auto"


@pytest.mark.slow
def test_a_requeued_step_over_a_finished_run_is_refused_on_the_command_line(tmp_path):
    run = tmp_path / "run"
    assert run_cli(FAST, run).returncode == 0
    before = _files(run)
    env_run = dict(os.environ, SLURM_RESTART_COUNT="1", SLURM_JOB_ID="5")
    proc = subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", *FAST, f"hydra.run.dir={run}"],
        env=env_run,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "already holds a run" in proc.stderr, proc.stderr
    assert _files(run) == before


# ------------------------------------------------------------------------------------------------ -m sweep dirs
def _sweep_config(
    tmp_path: Path, sweep: Path, sweeper: str = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
):
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}, "sweeper": {"_target_": sweeper}}})


@pytest.mark.slow
def test_a_basic_sweep_never_writes_over_an_earlier_sweeps_jobs(tmp_path):
    """`-m` with Hydra's basic sweeper wrote its jobs to <sweep dir>/0, 1, ... again, over finished runs."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "lychee_exp.run", "-m", *FAST, f"hydra.sweep.dir={sweep}", "seed=1,2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert (sweep / "0" / RUN_MARKER).is_file() and (sweep / "1" / "metrics.json").is_file()
    before = _files(sweep)
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = output_lines(again)
    assert again.returncode == 2 and len(lines) == 1, lines
    assert f"hydra.sweep.dir={sweep} holds an earlier sweep's jobs (0, 1): this sweep would write its jobs" in lines[0]
    assert _files(sweep) == before and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
def test_a_sweep_directory_is_checked_and_locked_before_the_first_job(tmp_path, launcher):
    """The check runs in the process that starts the jobs, whichever launcher starts them; two sweeps into one
    directory at once are refused (wrong code: a check without the lock lets both through)."""
    sweep = tmp_path / "sweep"
    config = _sweep_config(tmp_path, sweep)
    config.hydra.launcher = {"_target_": f"hydra_plugins.x.{launcher}"}
    RunDirGuard().on_multirun_start(config)
    with pytest.raises(RunDirRefused, match="is in use by another command"):
        run_dir._sweep_lock, held = None, run_dir._sweep_lock  # a second sweep process, with its own lock
        try:
            RunDirGuard().on_multirun_start(config)
        finally:
            run_dir._sweep_lock = held
    _run_dir(sweep / "0")
    RunDirGuard().on_multirun_end(config)
    with pytest.raises(RunDirRefused, match=r"holds an earlier sweep's jobs \(0\): this sweep would write its jobs"):
        RunDirGuard().on_multirun_start(config)
    (sweep / "notes.txt").write_text("mine\n")
    with pytest.raises(RunDirRefused, match=r"holds files \(0, notes.txt\): this sweep would write its jobs"):
        RunDirGuard().on_multirun_start(config)
    # the lychee sweeper continues its study there and claims a fresh directory per trial: let in
    RunDirGuard().on_multirun_start(_sweep_config(tmp_path, sweep, "hydra_plugins.lychee_optuna_sweeper.X"))


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda t: (t / "afile").write_text("mine\n") and t / "afile", "afile is a file; a sweep writes a directory"),
        (lambda t: t / ("s" * 300), "is 300 bytes long; this file system takes at most 255"),
        (lambda t: _read_only(t / "ro") / "sweep", "ro is not writable"),
        (lambda t: _run_dir(t / "run") / "sweep", "is inside the run directory .*/run: a sweep's directory is its own"),
    ],
)
def test_a_sweep_directory_that_cannot_be_one_is_one_line(tmp_path, make, expected):
    config = _sweep_config(tmp_path, make(tmp_path))
    config.hydra.sweeper._target_ = "hydra_plugins.lychee_optuna_sweeper.X"
    with pytest.raises(RunDirRefused, match=expected):
        RunDirGuard().on_multirun_start(config)


def _read_only(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o555)  # root writes anyway: the policy reads the mode bits
    return path


# -------------------------------------------------------------------------------- outputs inside models and runs
def test_no_flag_reaches_inside_a_model_a_dataset_or_a_run(tmp_path, ir_cache, capsys, caplog):
    """mine ... out=<a trained model>/config.json overwrite=true replaced the model's config. A model directory, a
    dataset or a run's files are never an output, whatever the flag (wrong code: a rule for inputs only, as before:
    this model is no input of mine)."""
    root = fruit_dataset(tmp_path / "fruit")
    run = _run_dir(tmp_path / "run")
    (run / "model" / "config.json").write_text('{"model_type": "qwen2"}\n')
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "optimization_results.yaml").write_text("name: optuna\n")
    (sweep / "optuna.db").write_bytes(b"SQLite format 3\x00")
    before = _user_files(tmp_path)
    cases = [
        (run / "model" / "config.json", "is inside .*/run/model, a model directory: write elsewhere"),
        (run / "model" / "new.jsonl", "is inside .*/run/model, a model directory: write elsewhere"),
        (run / "metrics.json", r"is inside a run directory \(.*/run\) and exists: the files of a run or a sweep are"),
        (sweep / "optuna.db", r"is inside a sweep directory \(.*/sweep\) and exists: the files of a run or a sweep"),
    ]
    for out, expected in cases:
        code, lines = _run("mine", _command("mine", root, out, "overwrite=true"), capsys, caplog)
        assert code == 2 and len(lines) == 1, lines
        assert re.search(expected, lines[0]), lines[0]
    assert _user_files(tmp_path) == before
    # a new file beside a run's own is no loss: allowed
    mine_entry.main(_command("mine", root, run / "mined.jsonl"))
    assert (run / "mined.jsonl").read_text().count("\n") == 6  # the 6 training queries


def test_an_earlier_rerank_inside_a_run_is_replaced_under_the_usual_rules(tmp_path, ir_cache, capsys, caplog):
    """rerank out=<run>/test twice: the second with overwrite=true replaces its own earlier results (a workflow
    users have), while out=<run>/model or out=<run>/logs with the flag is refused (a directory the run wrote)."""
    root = fruit_dataset(tmp_path / "fruit")
    run = _run_dir(tmp_path / "run")
    (run / "logs").mkdir()
    (run / "logs" / "0.log").write_text("rank 0\n")
    rerank_entry.main(_command("rerank", root, run / "test"))
    first = (run / "test" / "run.trec").read_text()
    rerank_entry.main(_command("rerank", root, run / "test", "overwrite=true", "top_k=3"))
    assert (run / "test" / "run.trec").read_text() != first  # the new results, whole
    before = _user_files(tmp_path)
    for theirs in ("model", "logs"):
        code, lines = _run("rerank", _command("rerank", root, run / theirs, "overwrite=true"), capsys, caplog)
        assert code == 2 and len(lines) == 1 and "the files of a run or a sweep are never replaced" in lines[0], lines
    assert _user_files(tmp_path) == before


@pytest.mark.parametrize("where", ["cwd", "home"])
def test_a_directory_output_is_never_the_users_ground(tmp_path, monkeypatch, where):
    ground = tmp_path / "ground"
    ground.mkdir()
    (ground / "run.trec").write_text("earlier\n")
    monkeypatch.chdir(ground if where == "cwd" else tmp_path)
    monkeypatch.setenv("HOME", str(ground))
    spec = "." if where == "cwd" else "~"
    refused = pytest.raises(UserError, match=f"out={spec} is the (current|home) directory")
    with refused, staged_output(spec, directory=True, overwrite=True, inputs=[], results=("run.trec",)):
        pass
    assert (ground / "run.trec").read_text() == "earlier\n"


# --------------------------------------------------------------------------------- names, full disks: one line
def test_a_name_longer_than_the_file_system_takes_is_one_line(tmp_path, ir_cache, capsys, caplog):
    root = fruit_dataset(tmp_path / "fruit")
    code, lines = _run("mine", _command("mine", root, tmp_path / ("n" * 256 + ".jsonl")), capsys, caplog)
    assert code == 2 and len(lines) == 1 and "is 262 bytes long; this file system takes at most 255" in lines[0]
    with pytest.raises(UserError, match="is 300 bytes long"):
        claim_run_dir(str(tmp_path / ("r" * 300) / "run"), resume="never", overwrite=False, inputs=[])


@pytest.mark.parametrize("which", ["mine", "rerank"])
def test_a_full_disk_is_one_line_and_keeps_the_earlier_results(tmp_path, ir_cache, capsys, caplog, small_disk, which):
    """ENOSPC from a real (tiny) file system while the results are written: exit 1, one line saying so, the earlier
    results byte for byte, no staging directory left (wrong code: a traceback, or a half-written file in place)."""
    root = fruit_dataset(tmp_path / "fruit")
    disk = small_disk(12)
    out = disk / ("train.jsonl" if which == "mine" else "out")
    if which == "mine":
        out.write_text("the earlier file\n")
    else:
        out.mkdir()
        (out / "run.trec").write_text("earlier\n")
    (disk / "filler").write_bytes(b"x" * 4096)  # what is left is less than the results take
    before = {str(p): p.read_bytes() for p in disk.rglob("*") if p.is_file()}
    code, lines = _run(which, _command(which, root, out, "overwrite=true"), capsys, caplog)
    assert code == 1 and len(lines) == 1, lines
    assert "No space left on device" in lines[0] and f"{out} left as it was" in lines[0], lines[0]
    assert {str(p): p.read_bytes() for p in disk.rglob("*") if p.is_file()} == before
    assert [p.name for p in disk.iterdir() if p.name.startswith(".")] == []


# --------------------------------------------------------------------------------------------------- stop signals
def _ddp_run_held_at_step_2(tmp_path: Path, nohup: bool = False) -> tuple[subprocess.Popen, Path]:
    """A 4-step DDP run in a process group of its own (a terminal's), its rank 0 waiting after step 2 until
    tmp_path/go exists; returned once it waits. nohup: started with SIGHUP ignored, as nohup starts it."""
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", LYCHEE_FAULT="0:2:wait", LYCHEE_FAULT_WAIT_FOR=str(tmp_path / "go"))
    ddp = [o for o in FAST if not o.startswith(("parallel=", "gpus="))] + ["parallel=ddp", "gpus=2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *ddp, "trainer.max_steps=4", f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup else None,  # noqa: PLW1509
    )
    deadline = time.monotonic() + 240
    while "LYCHEE_FAULT wait fired" not in _rank_logs(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc, run


def _rank_logs(run: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in run.glob("logs/**/stderr.log"))


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGHUP, 129), (signal.SIGQUIT, 131)])
def test_sighup_and_sigquit_end_a_ddp_run_as_sigterm_does(tmp_path, signum, code):
    """A closed terminal (SIGHUP) or Ctrl-\\ (SIGQUIT) while the ranks train: one line naming the signal, exit
    128 + its number, no process left (it used to train on, save, then exit 129/131 without a line or
    metrics.json)."""
    proc, run = _ddp_run_held_at_step_2(tmp_path)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    lines = [line for line in out.splitlines() if line.strip() and "][INFO] - " not in line and "[rank" not in line]
    name = signal.Signals(signum).name
    assert proc.returncode == code and lines == [f"terminated ({name})"], out
    assert not (run / "metrics.json").exists()
    time.sleep(1)
    assert live_processes_in_group(proc.pid) == []


@pytest.mark.slow
def test_a_run_under_nohup_trains_on_through_sighup(tmp_path):
    """nohup ignores SIGHUP: the run must keep that (torch's agent would otherwise install its own handler)."""
    proc, run = _ddp_run_held_at_step_2(tmp_path, nohup=True)
    os.killpg(proc.pid, signal.SIGHUP)  # the terminal's whole process group, ranks included
    time.sleep(2)
    (tmp_path / "go").write_text("")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0 and run_metrics(run)["steps"] == 4, out


# ------------------------------------------------------------------------------------------------------- locks
def test_a_shared_tables_lock_goes_when_its_writer_lets_go(tmp_path):
    """throughput_baselines.json.lock and trials.csv.lock stayed beside their tables (docs say locks go)."""
    table = tmp_path / "throughput_baselines.json"
    update_json_locked(table, lambda t: t.update(a=1))
    update_json_locked(table, lambda t: t.update(b=2))
    assert json.loads(table.read_text()) == {"a": 1, "b": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["throughput_baselines.json"]


def test_concurrent_updates_of_a_shared_table_all_stay(tmp_path):
    """The lock still serialises writers across processes (wrong code: a lock file removed too early lets two in,
    and one entry is lost)."""
    table = tmp_path / "table.json"
    code = (
        "import sys; from pathlib import Path; from lychee_exp.io.atomic import update_json_locked\n"
        "for i in range(40): update_json_locked(Path(sys.argv[1]), lambda t: t.update({f'{sys.argv[2]}{i}': i}))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(table), name]) for name in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(json.loads(table.read_text())) == 80
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


def test_resolved_handles_a_name_too_long_to_stat(tmp_path):
    assert resolved(str(tmp_path / ("z" * 300))).name == "z" * 300
