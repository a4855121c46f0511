"""The jobs a command submits through hydra-submitit-launcher (hydra/launcher=slurm, slurm_cpu, slurm_local), seen
from the submitting process (hydra_plugins/lychee_submitit_launcher uses it):

- before any job is submitted: the launcher's settings the project cannot run (tasks_per_node other than 1, no
  node), and on Slurm `sbatch --test-only` of the very script submitit would submit, so that a job Slurm refuses
  (an unknown partition, more memory or CPUs than a node has) is one line naming the settings, exit 2, and a
  controller that does not answer is one line, exit 1;
- while waiting: submitit learns that a job ended from its result file, else from `sacct` (rarely, and never where
  accounting is off); a job cancelled or killed outside the command writes no result, so Slurm's own view
  (`squeue`, then `sacct`) is asked every CHECK_EVERY_S and such a job ends the wait in one line, exit 1;
- submitit's status checks ask sacct, which without accounting fails at each check with a line of its own and
  submitit's "Bypassing sacct error" (39 of a 70-line sweep's output): the wait reads the result files instead,
  and the warning, where submitit still checks, is said once per sweep (say_once_per_sweep);
- when the user stops the command (Ctrl-C, SIGTERM): `cancel_in_flight` cancels the jobs it is still waiting for
  and gives the words for the command's one line (run.main says it).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lychee_exp.errors import RunFailed, UserError

CHECK_EVERY_S = 10.0  # how often Slurm is asked whether a job still runs while no result has come
RESULT_GRACE_S = 15.0  # a job that ended may write its result a moment later (submitit's own wait on shared disks)
COMMAND_TIMEOUT_S = 60.0  # sbatch --test-only, squeue, sacct, scancel: each answers in seconds or not at all
# Slurm's states of a job that will not run again (a requeued one goes back to PENDING)
ENDED = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
SACCT_BYPASSED = "Bypassing sacct error"  # submitit's warning when sacct fails (it goes on without sacct)
GONE = "GONE"  # neither squeue nor sacct knows the job any more
# the settings a refusal names: what a node's request is made of
RESOURCES = ("partition", "account", "nodes", "gpus_per_node", "cpus_per_task", "mem_gb", "timeout_min")


# ------------------------------------------------------------------------------------------ before submitting
def check_settings(params: Mapping[str, Any], executor: str) -> None:
    """The launcher settings lychee_exp cannot run, refused before anything is submitted (submitit would pass
    nodes=0 to sbatch, and tasks_per_node=2 would start every Hydra job twice per node)."""
    tasks = params.get("tasks_per_node", 1)
    if tasks != 1:
        raise UserError(
            f"hydra.launcher.tasks_per_node={tasks}: keep 1; lychee_exp starts each node's ranks itself "
            "(one per GPU, or `gpus` CPU ranks), one task per node (docs/cluster.md)"
        )
    nodes = params.get("nodes", 1)
    if nodes < 1:
        raise UserError(f"hydra.launcher.nodes={nodes}: a job needs at least 1 node")
    if executor == "local" and nodes != 1:
        raise UserError(
            f"hydra.launcher.nodes={nodes}: hydra/launcher=slurm_local runs each job on this machine (1 node); "
            "several nodes: hydra/launcher=slurm"
        )


def check_slurm_reachable(environ: Mapping[str, str] = os.environ) -> None:
    """What submitit needs before it can even write a script: Slurm's commands here, and SLURM_CONF a file."""
    conf = environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        raise UserError(f"SLURM_CONF={conf}: no such file (the cluster's slurm.conf; unset it for the default)")
    missing = [name for name in ("sbatch", "srun") if shutil.which(name) is None]
    if missing:
        raise UserError(
            f"hydra/launcher=slurm: no {' or '.join(missing)} here; submit from a Slurm login node "
            "(on this machine: hydra/launcher=slurm_local)"
        )


def check_slurm_accepts(script: str, params: Mapping[str, Any]) -> None:
    """`sbatch --test-only` of the job's script: Slurm checks the request as it would the submission, and
    submits nothing."""
    with tempfile.NamedTemporaryFile("w", prefix="lychee-sbatch-", suffix=".sh") as handle:
        handle.write(script)
        handle.flush()
        try:
            proc = _slurm_command(["sbatch", "--test-only", handle.name])
        except subprocess.TimeoutExpired:
            raise RunFailed(
                f"sbatch --test-only did not answer in {COMMAND_TIMEOUT_S:.0f} s: is the Slurm controller up (sinfo)?",
                "crashed",
            ) from None
    if proc.returncode != 0:
        raise sbatch_refusal(proc.stderr, params)


def sbatch_refusal(stderr: str, params: Mapping[str, Any]) -> Exception:
    """sbatch's refusal as one line: the controller not answering is a failure (exit 1), anything else a request
    this cluster cannot meet, i.e. the settings (exit 2)."""
    reason = last_line(stderr, "sbatch refused the job")
    reason = re.sub(r"^(sbatch: error: |allocation failure: |sbatch: fatal: )", "", reason)
    if "contact slurm controller" in reason.lower():
        return RunFailed(f"the Slurm controller does not answer ({reason}): is it up (sinfo)?", "crashed")
    asked = ", ".join(f"{key}={params[key]}" for key in RESOURCES if params.get(key) is not None)
    extra = params.get("additional_parameters") or {}
    asked += "".join(f", additional_parameters.{key}={value}" for key, value in extra.items())
    return UserError(
        f"Slurm refuses the job: {reason} (hydra.launcher: {asked}); `sinfo -o '%P %D %c %m %G'` shows what the "
        "partitions offer"
    )


# ------------------------------------------------------------------------------------------------ waiting
def job_result(job: Any) -> Any:
    """What upstream's launcher takes, `job.results()[0]` (task 0's Hydra JobReturn), once the job wrote it; a
    job that ended without writing it, or whose task failed outside Hydra's job, as one line."""
    state = None
    next_check = time.monotonic() + CHECK_EVERY_S
    # on Slurm the result files alone, not job.done(): that asks sacct, whose failures (accounting off) print a
    # line of sacct's own and a warning of submitit's at each check; Slurm's view is slurm_state's, captured
    while not (_results_exist(job) if _on_slurm(job) else job.done()):
        time.sleep(1.0)
        if _on_slurm(job) and time.monotonic() >= next_check:
            state = slurm_state(job.job_id)
            if state in ENDED or state == GONE:
                break
            next_check = time.monotonic() + CHECK_EVERY_S
    if not _wrote_results(job, RESULT_GRACE_S):
        where = f"Slurm job {job.job_id}" if _on_slurm(job) else f"local job {job.job_id}"
        ended = f"ended {state}" if state and state != GONE else "ended"
        raise RunFailed(
            f"{where} {ended} without a result (cancelled or killed outside this command); its log: {job.paths.stderr}",
            "crashed",
        )
    from submitit.core.utils import UncompletedJobError

    try:
        return job.results()[0]
    except UncompletedJobError as err:  # raised outside Hydra's job: submitit's message holds the whole trace
        raise job_failure(str(err), job) from None


def job_failure(message: str, job: Any) -> Exception:
    """A task's failure that submitit reports as its multi-line trace: the trace's last line, a UserError where
    the job raised one."""
    parts = message.split("-" * 22)  # submitit's rule around the trace
    last = last_line(parts[1] if len(parts) > 2 else message, "failed")
    kind, _, text = last.partition(": ")
    if kind == f"{UserError.__module__}.{UserError.__qualname__}":
        return UserError(text)
    return RunFailed(f"job {job.job_id} failed: {last}; its log: {job.paths.stderr}", "crashed")


def slurm_state(job_id: str) -> str | None:
    """Slurm's state of a job (an array task as <id>_<k>): squeue's while slurmctld keeps the job (MinJobAge),
    then sacct's; GONE when neither knows it; None when Slurm does not answer (ask again later)."""
    try:
        queue = _slurm_command(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])
        if queue.returncode == 0 and queue.stdout.split():
            return queue.stdout.split()[0]
        if queue.returncode != 0 and "invalid job id" not in queue.stderr.lower():
            return None
        accounted = _slurm_command(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    except (subprocess.TimeoutExpired, OSError):
        return None
    if accounted.returncode == 0 and accounted.stdout.split():
        return accounted.stdout.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return GONE


def _results_exist(job: Any) -> bool:
    return all(job.task(k).paths.result_pickle.exists() for k in range(job.num_tasks))


def _wrote_results(job: Any, grace_s: float) -> bool:
    deadline = time.monotonic() + grace_s
    while not _results_exist(job):
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return True


def _on_slurm(job: Any) -> bool:
    return type(job).__name__ == "SlurmJob"


def _slurm_command(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)


def last_line(text: str, default: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else default


# ------------------------------------------------------------------------------------ jobs in flight, Ctrl-C
_lock = threading.Lock()
_in_flight: dict[str, Any] = {}  # job id -> submitit job, from submission until its result came back
_stopping = False


def submitted(jobs: Sequence[Any]) -> None:
    """Jobs this process now waits for; cancelled at once if the command is already stopping (a sweep's slot
    thread may submit while the main thread unwinds from Ctrl-C)."""
    with _lock:
        if not _stopping:
            _in_flight.update((job.job_id, job) for job in jobs)
            return
    _cancel(list(jobs))


def returned(jobs: Sequence[Any]) -> None:
    with _lock:
        for job in jobs:
            _in_flight.pop(job.job_id, None)


def cancel_in_flight() -> str:
    """Cancels every job submitted here whose result has not come back (the user stopped the command), and any
    submitted from now on; the words for the command's one line ("" when there was none)."""
    global _stopping
    with _lock:
        _stopping = True
        jobs = sorted(_in_flight.values(), key=lambda job: [int(n) for n in re.findall(r"\d+", job.job_id)])
        _in_flight.clear()
    return _cancel(jobs)


def _cancel(jobs: list[Any]) -> str:
    if not jobs:
        return ""
    slurm = [job.job_id for job in jobs if _on_slurm(job)]
    words = []
    for job in jobs:
        if not _on_slurm(job):
            job.cancel(check=False)  # SIGINT to the local job's controller, which stops its tasks
    if len(slurm) < len(jobs):
        words.append(f"stopped local job(s) {', '.join(job.job_id for job in jobs if not _on_slurm(job))}")
    if slurm:
        try:
            proc = _slurm_command(["scancel", *slurm])
            failed = proc.returncode != 0 and last_line(proc.stderr, f"exit {proc.returncode}")
        except (subprocess.TimeoutExpired, OSError) as err:
            failed = str(err)
        ids = ", ".join(slurm)
        words.append(
            f"Slurm job(s) {ids} may still run (scancel failed: {failed}): scancel {' '.join(slurm)}"
            if failed
            else f"cancelled Slurm job(s) {ids}"
        )
    return "; " + "; ".join(words)


class SaidOnce(logging.Filter):
    """Lets the first record that holds `text` through, saying that it is not repeated, and drops the rest."""

    def __init__(self, text: str, note: str) -> None:
        super().__init__()
        self.text, self.note, self.said = text, note, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in str(record.msg):
            return True
        if self.said:
            return False
        self.said = True
        record.msg, record.args = f"{record.getMessage()} ({self.note})", ()
        return True


def say_once_per_sweep() -> None:
    """submitit warns "Bypassing sacct error" at every status check while sacct fails (a cluster without
    accounting); the wait does not need sacct (results come from their files, a lost job from squeue: job_result),
    so the first warning is enough. A fresh filter per sweep, in place of the last sweep's."""
    submitit_log = logging.getLogger("submitit")
    for old in [f for f in submitit_log.filters if isinstance(f, SaidOnce)]:
        submitit_log.removeFilter(old)
    submitit_log.addFilter(SaidOnce(SACCT_BYPASSED, "said once per sweep: the wait reads the jobs' result files"))
