"""The SLURM paths on a real Slurm: a throwaway controller and two slurmd node names on this host
(tools/local_slurm.py), driven through the user's commands. Sweep trials as sbatch jobs (n_jobs at
once) with a failing rank, a job of two nodes under srun equal to in-process DDP, a preempted trial requeued by
Slurm that continues from its checkpoint, and launch/slurm/sweep_array.sbatch as an array job on one study. And
what goes wrong: settings Slurm refuses (one line before any job), a user error inside a job (the job's line),
Ctrl-C/SIGTERM of the command (its jobs cancelled), a job cancelled from outside (the wait ends in one line).
What only a real cluster shows stays out of the other test_cluster* files (there: submitit's local executor, a
stand-in srun, faked SLURM variables)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from cluster_helpers import TINY_MULTI, cluster_env, require_slurm, start_until_step_2
from conftest import REPO_ROOT, output_lines, run_metrics
from equivalence import assert_same_training

from lychee_exp.job.in_process import run_job
from lychee_exp.launch.processes import free_port
from tools.local_slurm import local_slurm

pytestmark = pytest.mark.slow

# conf/hydra/launcher/slurm_cpu.yaml: slurm.yaml for nodes without GPUs, sized for local_slurm's 1-CPU nodes
LAUNCH = ["hydra/launcher=slurm_cpu"]
SWEPT = ("optimizer.lr=", "data.batch_size=")  # lr_batch searches them: not fixed on the command line


@pytest.fixture(scope="module")
def slurm():
    require_slurm()
    with local_slurm(nodes=2) as cluster:
        yield cluster


def _cli(
    slurm, args: list[str], cwd: Path, timeout: float = 400, expect: int = 0, **env: str
) -> subprocess.CompletedProcess:
    """`python -m lychee_exp.run <args>` as a user on the cluster's login node would run it; its exit code must be
    `expect`."""
    proc = subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=cwd,
        env=cluster_env(**{"SLURM_CONF": str(slurm.conf), **env}),
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == expect, f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}\n{slurm.logs()}"
    return proc


def _job(slurm, job_id: str) -> dict[str, str]:
    """`scontrol show job` of one job (or array task) as key -> value."""
    text = slurm.run("scontrol", "show", "job", "-o", job_id)
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _ended(slurm, job_id: str, timeout: float = 60) -> dict[str, str]:
    """The job's record once it ended: the sweeper has its result as soon as the job wrote it, and Slurm marks
    the job finished a moment later (its step and batch script exit)."""
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")

    def record() -> dict[str, str] | None:
        state = _job(slurm, job_id)
        return state if state["JobState"] in final else None

    return slurm.wait_for(f"job {job_id} ending", record, timeout)


def _submitit_jobs(sweep: Path) -> list[str]:
    """The Slurm job ids submitit recorded, one folder each (array tasks as <array id>_<task>)."""
    return sorted(p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+(_\d+)?", p.name))


# ------------------------------------------------------------------------ a sweep whose trials are sbatch jobs
@pytest.fixture(scope="module")
def slurm_sweep(slurm, tmp_path_factory) -> Path:
    """lr_batch, 2 trials, n_jobs=2, each trial a job of 2 DDP ranks. Trial 1's rank 1 raises after step 2."""
    root = tmp_path_factory.mktemp("slurm-sweep")
    sweep = root / "sweep"
    args = ["-m", *LAUNCH, "hparams_search=lr_batch", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2"]
    args += ["hydra.sweeper.max_failure_rate=1", "parallel=ddp", "gpus=2", "trainer.max_steps=4"]
    args += [*(a for a in TINY_MULTI if not a.startswith(SWEPT)), f"hydra.sweep.dir={sweep}"]
    proc = _cli(slurm, args, root, LYCHEE_FAULT="1:2:raise:1")
    (root / "output.txt").write_text(proc.stdout + proc.stderr)  # what the user saw
    return sweep


def test_sweep_trials_run_as_slurm_jobs_at_once(slurm, slurm_sweep):
    """Would fail if the trials ran anywhere but in batch jobs of this cluster (no job ids, or ids slurmctld does
    not know), one after another (Slurm's start and end times would not overlap), or if the results did not reach
    the study."""
    import optuna

    sweep = slurm_sweep
    jobs = _submitit_jobs(sweep)
    assert len(jobs) == 2, jobs  # a job per trial (the sweeper hands each slot its next trial on its own)
    first, second = (_ended(slurm, job) for job in jobs)
    for record in (first, second):
        # COMPLETED even for the failed trial: the job returns Hydra's JobReturn, which carries the trial's error
        assert record["JobState"] == "COMPLETED" and record["BatchFlag"] == "1", record
        assert record["NodeList"] in slurm.nodes, record
    assert second["StartTime"] < first["EndTime"] and first["StartTime"] < second["EndTime"], (first, second)
    study = optuna.load_study(study_name="lr_batch", storage=f"sqlite:///{sweep / 'optuna.db'}")
    done, failed = study.trials
    assert (done.state.name, failed.state.name) == ("COMPLETE", "FAIL")
    m = run_metrics(sweep / "0")
    assert done.value == m["model_ndcg@10"] and m["num_devices"] == m["num_processes"] == 2 and m["steps"] == 4
    assert m["effective_batch_size"] == done.params["trainer.global_batch_size"]
    # accounting is off here: no sacct failure printed at each status check (39 of 70 lines before)
    output = (sweep.parent / "output.txt").read_text()
    assert output.count("Bypassing sacct error") == 0 and "accounting storage is disabled" not in output, output
    assert "categorical units" not in output  # the plots' matplotlib advice (sweep_results._quiet)


def test_a_failed_rank_fails_its_job_and_the_trial(slurm, slurm_sweep):
    """Would fail if the rank's error stayed inside the job (its trial left RUNNING and the sweep waiting: the
    subprocess timeout would end it) or reached the sweeper without its reason."""
    import csv

    jobs = _submitit_jobs(slurm_sweep)
    with (slurm_sweep / "trials.csv").open() as handle:
        rows = {row["number"]: row for row in csv.DictReader(handle)}
    assert rows["1"]["state"] == "FAIL" and rows["1"]["reason"].startswith("crashed: rank 1 failed"), rows
    assert "injected fault" in rows["1"]["reason"] and not (slurm_sweep / "1" / "metrics.json").exists()
    logs = {job: "".join(p.read_text() for p in (slurm_sweep / ".submitit" / job).glob("*_log.*")) for job in jobs}
    [failed] = [job for job, log in logs.items() if "injected fault on rank 1" in log]
    state = _ended(slurm, failed)
    rank1 = "".join(p.read_text() for p in (slurm_sweep / "1").glob("logs/**/1/stderr.log"))
    fired = float(re.findall(r"LYCHEE_FAULT raise fired at ([\d.]+)", rank1)[0])
    ended = datetime.fromisoformat(state["EndTime"]).timestamp()  # Slurm's local time, to the second
    print(f"job {failed} ended {ended - fired:.0f} s after the fault (slurmctld's EndTime, 1 s resolution)")


# ------------------------------------------------------------------------------------- two nodes under srun
def test_two_node_job_under_srun_matches_in_process_ddp(slurm, tmp_path):
    """hydra.launcher.nodes=2: sbatch -N2, srun starts one task per node (node1, node2: two slurmd), each task's
    agent one rank; they meet at MASTER_ADDR. Would fail if the ranks did not form one process group (each would
    train alone: other gradients), if a node's batch were counted twice, or if the weights drifted."""
    args = [*TINY_MULTI, "trainer.save_model=true", "trainer.measure_speedup=false"]
    reference = tmp_path / "in-process"
    run_job([*args, "parallel=ddp", "gpus=2"], reference)
    sweep = tmp_path / "sweep"
    two_nodes = ["-m", *LAUNCH, "hydra.launcher.nodes=2", *args, "parallel=ddp", "gpus=1"]
    two_nodes += ["parallel.cpu_threads_per_rank=1", "trainer.global_batch_size=4", f"hydra.sweep.dir={sweep}"]
    # the one thing one host cannot give: node names that resolve (node1, node2); a real cluster's do
    _cli(slurm, two_nodes, tmp_path, MASTER_ADDR="127.0.0.1")
    [job] = _submitit_jobs(sweep)
    state = _ended(slurm, job)
    assert (state["JobState"], state["NumNodes"], state["NodeList"]) == ("COMPLETED", "2", "node[1-2]"), state
    m = run_metrics(sweep / "0")
    assert m["num_devices"] == 2 and m["num_processes"] == 2 and m["steps"] == 4
    assert_same_training(sweep / "0", reference)  # every step's loss and pre-clip gradient norm, the weights
    want = run_metrics(reference)
    for key in ("initial_ndcg@10", "ndcg@10", "mrr@10"):
        assert m[key] == pytest.approx(want[key], abs=1e-6), key


# ------------------------------------------------------------------------------ preemption: USR2, requeue
def test_preempted_job_is_requeued_by_slurm_and_ends_as_if_uninterrupted(slurm, tmp_path):
    """`scancel --signal=USR2` (what Slurm sends signal_delay_s before the time limit) while the trial trains:
    the ranks checkpoint, submitit runs `scontrol requeue` on its own job, Slurm starts it again and it resumes.
    Would fail if the signal killed the job (FAILED, or no requeue: Restarts=0; it did, before the forkserver
    ignored USR2), if the requeued job started over instead of resuming (no "resumed from" line at the stopped
    step), or if the resume lost state (optimizer, data position, RNG: the later steps would differ from the
    uninterrupted run's)."""
    args = [*TINY_MULTI, "parallel=ddp", "gpus=2", "trainer.max_steps=40", "trainer.measure_speedup=false"]
    args += ["trainer.save_model=true", "trainer.eval_before_training=false"]
    sweep = tmp_path / "sweep"
    proc = start_until_step_2(
        ["-m", *LAUNCH, *args, f"hydra.sweep.dir={sweep}"],
        tmp_path,
        "sweep/0/logs/**/0/stderr.log",
        timeout_s=240,
        SLURM_CONF=str(slurm.conf),
    )
    try:
        [job] = slurm.wait_for("the job in squeue", lambda: _submitit_jobs(sweep), timeout=30)
        slurm.run("scancel", "--signal=USR2", job)
        out, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"{out[-3000:]}\n{slurm.logs()}"
    state = _ended(slurm, job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), state
    resumed = re.findall(r"resumed from \S+ at step (\d+) ", (sweep / "0" / "run.log").read_text())
    assert len(resumed) == 1 and 2 <= int(resumed[0]) < 40, resumed
    reference = tmp_path / "uninterrupted"
    run_job(args, reference)
    assert run_metrics(sweep / "0")["steps"] == 40
    assert_same_training(sweep / "0", reference)  # each step's loss and gradient norm, the final weights
    print(f"job {job}: stopped after step {resumed[0]}, requeued by Slurm, resumed, finished 40 steps")


# --------------------------------------------------------------------------- launch/slurm/sweep_array.sbatch
def test_sweep_array_script_as_an_array_job(slurm, tmp_path):
    """sbatch --array=0-1 of the shipped script (its #SBATCH sizes overridden on the command line, as a user with
    a smaller node would): two workers, one SQLite study, n_trials=2. Worker 0's trial 0 holds after its first
    step until trial 1's directory exists, which only worker 1 can make: so each worker runs one trial, at the same
    time. Would fail if the tasks used separate studies (each would run 2 trials, or worker 1 would not find the
    study), if a task did not run the sweep to the end, or if the study ran more or fewer than n_trials."""
    import optuna

    sweep, db = tmp_path / "sweep", tmp_path / "study.db"
    (tmp_path / "outputs" / "slurm").mkdir(parents=True)  # --output's directory, as the script's header says
    tiny = [a for a in TINY_MULTI if not a.startswith(SWEPT)]
    env = cluster_env(SLURM_CONF=str(slurm.conf), LYCHEE_FAULT="0:1:wait:0", LYCHEE_FAULT_WAIT_FOR=str(sweep / "1"))
    env |= {"LYCHEE_STORAGE": f"sqlite:///{db}", "PYTHON": sys.executable}
    sbatch = ["sbatch", "--parsable", "--array=0-1", "--cpus-per-task=1", "--mem=1G", "--time=20", "--gpus-per-node=0"]
    script = [str(REPO_ROOT / "launch/slurm/sweep_array.sbatch"), "hparams_search=lr_batch"]
    script += ["hydra.sweeper.n_trials=2", "gpus=1", *tiny, "trainer.measure_speedup=false", f"hydra.sweep.dir={sweep}"]
    submitted = subprocess.run([*sbatch, *script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.strip().split(";")[0]
    tasks = [f"{array}_0", f"{array}_1"]
    states = [_ended(slurm, task, timeout=400)["JobState"] for task in tasks]
    outputs = [(tmp_path / "outputs" / "slurm" / f"lychee-sweep_{task}.out").read_text() for task in tasks]
    assert states == ["COMPLETED", "COMPLETED"], f"{states}\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}"
    assert "resuming study lr_batch in" in outputs[1], outputs[1][-3000:]  # the one worker 0 created
    for out in outputs:
        assert "2/2 trials finished (2 complete, 0 pruned, 0 failed); this worker ran 1;" in out, out[-3000:]
    study = optuna.load_study(study_name="lr_batch", storage=f"sqlite:///{db}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert sorted(p.parent.name for p in sweep.glob("*/metrics.json")) == ["0", "1"]


# ------------------------------------------------------------------ what goes wrong: one line, nothing left running
def _conf_without_controller(slurm, tmp_path: Path) -> Path:
    """This cluster's slurm.conf with the controller on a port nothing listens on (slurmctld down)."""
    conf = tmp_path / "slurm.conf"
    port = free_port()
    conf.write_text(re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={port}", slurm.conf.read_text()))
    return conf


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines a user reads as an error: ours, Hydra's line before a failed job's error, anything logged at
    ERROR, submitit's dump of a failed job, a traceback."""
    marks = ("error:", "Error executing job", "[ERROR]", "failed during processing", "Traceback")
    return [line for line in output_lines(proc) if any(mark in line for mark in marks)]


SUBMISSION_MISTAKES = {
    # docs/cluster.md: "a step with more tasks than nodes is refused in one line"; sbatch would accept it where a
    # node has the CPUs, and every rank would run the whole Hydra job
    "tasks_per_node=2": (["hydra.launcher.tasks_per_node=2"], {}, 2, "hydra.launcher.tasks_per_node=2: keep 1"),
    "nodes=0": (["hydra.launcher.nodes=0"], {}, 2, "hydra.launcher.nodes=0"),  # sbatch --test-only passes it
    "unknown partition": (["hydra.launcher.partition=nosuch"], {}, 2, "Invalid partition name"),
    "too much memory": (["hydra.launcher.mem_gb=100000"], {}, 2, "mem_gb=100000"),
    "no such slurm.conf": ([], {"SLURM_CONF": "/nonexistent/slurm.conf"}, 2, "SLURM_CONF=/nonexistent/slurm.conf"),
    "controller down": ([], {"SLURM_CONF": "down"}, 1, "the Slurm controller does not answer"),
    # the sweeper sets the launcher up before its first trial: the same line, no trial, no study
    "sweep, unknown partition": (
        ["hparams_search=lr_batch", "hydra.launcher.partition=nosuch"],
        {},
        2,
        "Invalid partition name",
    ),
}


@pytest.mark.parametrize("case", list(SUBMISSION_MISTAKES))
def test_a_job_slurm_would_refuse_is_one_line_before_any_is_submitted(slurm, tmp_path, case):
    """Would fail on a traceback (submitit's FailedJobError, what each did before), on a job submitted anyway
    (squeue lists one more; tasks_per_node=2 used to reach sbatch), or on a sweep directory begun."""
    overrides, env, code, words = SUBMISSION_MISTAKES[case]
    if env.get("SLURM_CONF") == "down":
        env = {"SLURM_CONF": str(_conf_without_controller(slurm, tmp_path))}
    before = slurm.jobs()
    sweep = tmp_path / "sweep"
    args = ["-m", *LAUNCH, *overrides, *TINY_MULTI, f"hydra.sweep.dir={sweep}"]
    proc = _cli(slurm, args, tmp_path, timeout=200, expect=code, **env)
    [line] = output_lines(proc)
    assert line.startswith("error: ") and words in line, line
    assert slurm.jobs() == before and not sweep.exists()


def test_a_user_error_inside_a_job_is_the_jobs_one_line(slurm, tmp_path):
    """A data file that is not there is found by the job (on the node that reads it): the submitting command
    says the job's own line and exits 2. Would fail on Hydra's "Error executing job with overrides" line, the
    job's traceback, or a line other than the job's."""
    sweep = tmp_path / "sweep"
    missing = tmp_path / "nosuch.jsonl"
    args = ["-m", *LAUNCH, *TINY_MULTI, "parallel=single", "gpus=1", "data=jsonl", f"data.train_file={missing}"]
    args += [f"data.dev_file={missing}", f"hydra.sweep.dir={sweep}"]
    proc = _cli(slurm, args, tmp_path, expect=2)
    [line] = _error_lines(proc)
    assert line.startswith("error: data.train_file=") and str(missing) in line, line
    [job] = _submitit_jobs(sweep)
    job_log = (sweep / "0" / "run.log").read_text()
    assert line in job_log, job_log[-2000:]  # the job's line, word for word
    assert _ended(slurm, job)["JobState"] == "COMPLETED"


def _training_job(slurm, tmp_path: Path, sweep_trials: bool = False) -> tuple[subprocess.Popen, Path]:
    """A long run (or a sweep of two trials at once) on the cluster, returned once a trial trains: the submitting
    process and its sweep directory."""
    sweep = tmp_path / "sweep"
    tiny = [a for a in TINY_MULTI if not (sweep_trials and a.startswith(SWEPT))]
    search = ["hparams_search=lr_batch", "hydra.sweeper.n_jobs=2"] if sweep_trials else []
    args = ["-m", *LAUNCH, *search, *tiny, "parallel=single", "gpus=1", "trainer.max_steps=100000"]
    args += ["trainer.evaluate=false", "trainer.measure_speedup=false", f"hydra.sweep.dir={sweep}"]
    proc = start_until_step_2(args, tmp_path, "sweep/*/run.log", timeout_s=240, SLURM_CONF=str(slurm.conf))
    return proc, sweep


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c-run", "sigterm-sweep"])
def test_stopping_the_command_cancels_its_jobs(slurm, tmp_path, stop):
    """Ctrl-C of a run; SIGTERM of a sweep with two trials in flight (their jobs are waited for in the sweeper's
    slot threads, not where the signal lands): every job is cancelled, and the one line says which. Would fail
    if a job were left RUNNING (what both did before), or the line did not name it."""
    sweep_trials = stop == signal.SIGTERM
    proc, sweep = _training_job(slurm, tmp_path, sweep_trials)
    try:
        want = 2 if sweep_trials else 1
        slurm.wait_for(f"{want} job(s)", lambda: len(_submitit_jobs(sweep)) == want, 120)
        jobs = sorted(_submitit_jobs(sweep), key=int)
        proc.send_signal(stop)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + stop and "Traceback" not in out, out[-3000:]
    [line] = [line for line in out.splitlines() if line.startswith(("interrupted", "terminated"))]
    assert line.endswith(f"; cancelled Slurm job(s) {', '.join(jobs)}"), line
    for job in jobs:
        assert _ended(slurm, job)["JobState"] == "CANCELLED", job


def test_a_job_cancelled_outside_ends_the_wait_in_one_line(slurm, tmp_path):
    """`scancel <job>` from another shell: the job writes no result, and without accounting submitit never learns
    that it ended. Would fail if the command waited on (the timeout below), exited 0, or said more than a line."""
    proc, sweep = _training_job(slurm, tmp_path)
    try:
        [job] = _submitit_jobs(sweep)
        slurm.run("scancel", job)
        out, _ = proc.communicate(timeout=120)  # slurm_jobs: CHECK_EVERY_S + RESULT_GRACE_S, and a margin
    finally:
        proc.kill()
    assert proc.returncode == 1, out[-3000:]
    log = sweep / ".submitit" / job / f"{job}_0_log.err"
    assert _error_lines(subprocess.CompletedProcess([], 1, out, "")) == [
        f"error: Slurm job {job} ended CANCELLED without a result (cancelled or killed outside this command); "
        f"its log: {log}"
    ], out[-3000:]
