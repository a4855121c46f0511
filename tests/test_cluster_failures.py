"""What goes wrong around the cluster paths, without a Slurm of the module's own: CPU ranks capped at the cores
(`gpus=100` on a 2-core machine), a job's failure that submitit reports as a multi-line trace and a job that ended
without a result (submitit's local executor: real job processes), and the throwaway cluster of local_slurm
stopped by a signal while it starts and while it serves (every daemon gone, checked by pid). The same cases on a
real Slurm (refused submissions, Ctrl-C, an external scancel): tests/test_cluster_slurm.py."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cluster_helpers import require_slurm
from conftest import TINY_OVERRIDES, output_lines, run_cli

from lychee_exp.config.auto import parse_gpus
from lychee_exp.errors import RunFailed, UserError
from lychee_exp.launch import slurm_jobs
from lychee_exp.parallel.devices import plan_devices


# ------------------------------------------------------------------------------------ CPU ranks and the cores
def test_cpu_ranks_are_capped_at_the_cores():
    """Would fail if gpus=100 still planned 100 processes on 2 cores, or if the cap reached the GPUs or the
    2 CPU ranks of the default job on 2 cores."""
    with pytest.raises(UserError, match=r"^gpus=100 but no CUDA GPU is visible, .* 100 CPU ranks on 2 core\(s\)"):
        plan_devices("ddp", 100, cuda_count=0, cores=2)
    with pytest.raises(UserError, match="gpus=3"):
        plan_devices("fsdp", 3, cuda_count=0, cores=2)
    assert plan_devices("ddp", 2, cuda_count=0, cores=2).num_processes == 2
    assert plan_devices("ddp", "auto", cuda_count=0, cores=2).num_processes == 2
    assert plan_devices("ddp", 8, cuda_count=8, cores=2).num_processes == 8  # GPUs: one process each, any cores


def test_too_many_cpu_ranks_is_one_line_before_any_rank(tmp_path):
    """The CLI: exit 2 and the one line, before a rank starts (no rank's log). Would fail on a traceback, or on
    ranks started and killed."""
    run_dir = tmp_path / "run"
    tiny = [a for a in TINY_OVERRIDES if not a.startswith(("parallel=", "gpus="))]
    proc = run_cli([*tiny, "parallel=ddp", "gpus=100"], run_dir)
    errors = [line for line in output_lines(proc) if "error" in line.lower() or "Traceback" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "gpus=100 but no CUDA GPU" in errors[0], errors
    assert not list(run_dir.glob("logs/**/stderr.log"))


# ------------------------------------------------------------------- a job's failure, seen from the submitter
@pytest.fixture
def local_executor(tmp_path):
    submitit = pytest.importorskip("submitit")
    executor = submitit.LocalExecutor(folder=tmp_path / "jobs")
    executor.update_parameters(timeout_min=5)
    return executor


def test_a_user_error_raised_in_a_job_is_its_line(local_executor):
    """A task that raises outside Hydra's job comes back as submitit's FailedJobError, a dozen lines of trace:
    the submitter says the error's own line, as the UserError it was. Would fail on the dump, or on a
    RunFailed (exit 1) for a user's mistake."""
    job = local_executor.submit(parse_gpus, "many")
    with pytest.raises(UserError) as raised:
        slurm_jobs.job_result(job)
    with pytest.raises(UserError) as direct:
        parse_gpus("many")
    assert str(raised.value) == str(direct.value)
    failed = local_executor.submit(int, "many")
    with pytest.raises(RunFailed, match=rf"^job {failed.job_id} failed: ValueError: invalid literal .*; its log: "):
        slurm_jobs.job_result(failed)


def test_a_job_that_ends_without_a_result_ends_the_wait(local_executor, monkeypatch):
    """A job killed from outside writes no result: one line naming it and its log, not submitit's
    UncompletedJobError of many lines. Would fail if the wait went on or the line were not one."""
    monkeypatch.setattr(slurm_jobs, "RESULT_GRACE_S", 1.0)
    job = local_executor.submit(time.sleep, 600)
    deadline = time.monotonic() + 60
    while not job.paths.stdout.exists():  # the task has started
        assert time.monotonic() < deadline
        time.sleep(0.2)
    job.cancel()
    with pytest.raises(RunFailed) as raised:
        slurm_jobs.job_result(job)
    assert str(raised.value) == (
        f"local job {job.job_id} ended without a result (cancelled or killed outside this command); its log: "
        f"{job.paths.stderr}"
    )


def test_submitits_sacct_warning_is_said_once_per_sweep(tmp_path, monkeypatch, caplog):
    """submitit's status checks where sacct fails (a cluster without accounting: 39 of a 70-line sweep's output)
    warn once per sweep: the first with a note, the rest dropped; the next sweep says it once again. Real submitit
    code, a sacct that fails as Slurm's does with accounting off. Would fail with the filter gone (5 lines), or
    one that outlived its sweep (0 lines the second time)."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    sacct = tmp_path / "sacct"
    sacct.write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    sacct.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def sweep() -> list[str]:
        caplog.clear()
        slurm_jobs.say_once_per_sweep()  # what the launcher's setup does
        watcher = SlurmInfoWatcher(delay_s=0)
        watcher.register_job("12")
        for _ in range(5):
            watcher.update()
        return [r.getMessage() for r in caplog.records if slurm_jobs.SACCT_BYPASSED in r.getMessage()]

    try:
        first, second = sweep(), sweep()
    finally:
        submitit_log = logging.getLogger("submitit")
        for said_once in [f for f in submitit_log.filters if isinstance(f, slurm_jobs.SaidOnce)]:
            submitit_log.removeFilter(said_once)
    assert len(first) == 1 and first[0].endswith("(said once per sweep: the wait reads the jobs' result files)")
    assert len(second) == 1


# ----------------------------------------------------------------------------------- local_slurm's own life
def _local_slurm(*args: str, tmpdir: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.Popen(
        [sys.executable, "-m", "tools.local_slurm", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_local_slurm_refuses_no_nodes_in_one_line():
    proc = _local_slurm("--nodes", "0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and (out + err).strip() == "error: --nodes 0: a cluster needs at least 1 node"


def _processes_under(directory: Path) -> dict[int, str]:
    """pid -> command line of every process whose command line names `directory` (the cluster's daemons: munged,
    slurmctld, slurmd all get their files there)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and str(directory) in cmdline:
            found[int(entry.name)] = cmdline
    return found


@pytest.fixture
def cluster_tmpdir():
    """The clusters' TMPDIR: searchable by everyone, as munged wants every directory above its socket."""
    path = Path(tempfile.mkdtemp(prefix="lychee-slurm-test-"))
    path.chmod(0o755)
    yield path
    for pid in _processes_under(path):  # what a failing test left running
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "serving"])
def test_sigterm_stops_every_daemon_of_local_slurm(cluster_tmpdir, when):
    """SIGTERM while the daemons start (the case that leaked munged and slurmctld: the start was not in the
    cleanup's reach), and once the cluster serves. Every daemon seen before the signal must be gone after, by
    pid, and nothing else that names the cluster's directory may run. Would fail if the signal killed the
    process outright (nothing stopped) or cut the start short without its cleanup."""
    require_slurm()
    proc = _local_slurm("--nodes", "2", tmpdir=cluster_tmpdir)
    try:
        deadline = time.monotonic() + 120
        kinds = ("munged", "slurmctld") if when == "starting" else ("munged", "slurmctld", "slurmd")
        while True:
            running = _processes_under(cluster_tmpdir)
            names = " ".join(running.values())
            if all(kind in names for kind in kinds) and (when == "starting" or names.count("slurmd ") == 2):
                break
            assert proc.poll() is None and time.monotonic() < deadline, f"no {kinds} yet: {running}"
            time.sleep(0.05)
        if when == "serving":
            assert proc.stdout.readline().startswith("export SLURM_CONF=")  # it serves
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    if when == "starting":
        assert "export SLURM_CONF" not in out, out  # the signal came before the cluster was ready
    for pid, cmdline in running.items():
        assert not Path(f"/proc/{pid}").exists(), f"still running: {pid} {cmdline}"
    assert _processes_under(cluster_tmpdir) == {} and list(cluster_tmpdir.iterdir()) == []
