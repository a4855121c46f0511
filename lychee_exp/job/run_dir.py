"""A training run's directory (hydra.run.dir) under the output policy of every command (docs/outputs.md): a
finished run is never replaced by default, no run writes into one of its inputs, two runs never share one, and
nothing of an earlier run changes until the new attempt has passed every check.

Checked and claimed in the Hydra process by a Hydra callback (`RunDirGuard.on_run_start`, registered in
conf/config.yaml), which runs after the config has composed and BEFORE Hydra creates the directory and writes its
`.hydra/` files and log there.
- A directory that holds a run (anything besides Hydra's own `.hydra/` and log) is refused in one line unless the
  command says what to do with it: `trainer.resume=auto` continues it (from its newest checkpoint; a finished run
  without one is refused, since it would be trained again from scratch), `overwrite=true` replaces it, whole,
  once the new run has finished (until then the old run waits beside it, hidden; a failed or interrupted new run
  puts it back).
- `overwrite=true` replaces only a lychee_exp run: a directory carrying the marker every run writes when it claims
  its directory (io.outputs.RUN_MARKER) and holding nothing a run does not write; never the current directory or
  one that holds it, the home directory, or an input.
- A run continued with trainer.resume keeps every file as it was until the job's checks have passed (`commit`):
  Hydra's `.hydra/` files are kept aside and its log's length noted, and both are put back if a check fails, the
  command is interrupted, or (found at the next claim) the process was killed. metrics.json and model/ stay until
  the continued run writes new ones.
- A restarted job (SLURM requeue, elastic restart: SLURM_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT > 0) is subject
  to the same rules; what lets it into its directory is the directory's own state: a run this very job started (its
  marker names the job) and has not finished is continued from its newest checkpoint; one it finished is left as it
  was (exit 0, so that a requeued script goes on to its next step).
- The run directory must not be, hold, or lie inside an input (model.path, the data files, the dataset), nor lie
  inside a model directory, a dataset or another run.
- The main process locks it (io.lock) for the whole job: a second run into it is refused at once.
Other processes of the same job (torchrun ranks other than 0, SLURM nodes other than the first) neither check nor
lock: the directory is theirs.

`-m` (Hydra multiruns): the lychee Optuna sweeper claims a fresh directory for each trial (sweep.trials); with any
other sweeper (Hydra's basic one, under any launcher) the jobs go to `<sweep dir>/<job number>`, which Hydra writes
into before any callback of the job runs: a sweep directory that holds an earlier sweep's jobs is refused in one line
before the first job, and the sweep directory is locked while the sweep runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from lychee_exp.errors import UserError
from lychee_exp.io.atomic import read_json, write_json_atomic
from lychee_exp.io.lock import OutputLock, short_name
from lychee_exp.io.outputs import (
    RUN_DIR,
    RUN_MARKER,
    RUN_NAMES,
    clean_leftovers,
    companion,
    directory_kind,
    listed,
    output_target,
    read_only,
    refuse_ground,
    refuse_inputs,
    refuse_protected,
    writable_parent,
)
from lychee_exp.io.user_files import resolve_path
from lychee_exp.launch.cluster import is_main_process

log = logging.getLogger("lychee_exp")
KEY = "hydra.run.dir"
FINISHED = ("metrics.json", "model")  # what only a run that ended writes
WEIGHT_KEYS = ("path", "kind", "lora.enabled", "lora.r", "lora.target_modules")  # which weights a model has
INPUT_KEYS = ("model.path", "data.train_file", "data.dev_file", "data.dataset")
RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # > 0: this job again, in its own directory
JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")  # a job's identity, the same across its restarts
REPLACED = "replaced"  # overwrite=true: `.<short name>.replaced-<pid>-*`, the old run until the new one finished
KEPT = "kept"  # a continued run: `.<short name>.kept-<pid>-*`, its .hydra/ and log lengths until the checks passed
# Hydra's basic sweeper writes this into a sweep directory; anything else there is an earlier sweep's
SWEEP_OWN = ("multirun.yaml",)


@dataclass
class _Claim:
    target: Path
    spec: str
    lock: OutputLock
    set_aside: Path | None  # overwrite=true: the old run, until the new one has finished
    kept: Path | None  # a continued run: what Hydra changes in it, until the checks passed


_claim: _Claim | None = None
_sweep_lock: OutputLock | None = None


class RunDirRefused(BaseException):
    """The run directory's one line. A BaseException, because Hydra turns an Exception raised by a callback into a
    warning and goes on (hydra/_internal/callbacks.py); run.main says the line and exits 2."""


class RunAlreadyFinished(BaseException):
    """A restarted job found the run it had finished: nothing to do. run.main says the line and exits 0."""


class RunDirGuard(Callback):
    """Hydra callback: checks and claims hydra.run.dir before Hydra writes into it, and a sweep's directory before
    its first job."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_main_process():
            return
        try:
            continued = claim_run_dir(
                str(OmegaConf.select(config, KEY)),
                resume=str(OmegaConf.select(config, "trainer.resume", default="never")),
                overwrite=bool(OmegaConf.select(config, "overwrite", default=False)),
                inputs=_inputs(config),
                restarted=restarted(),
            )
        except UserError as err:
            raise RunDirRefused(str(err)) from None
        if continued and OmegaConf.select(config, "trainer.resume", default="never") == "never":
            with open_dict(config):  # this job's own run, restarted: from its newest checkpoint, if any
                config.trainer.resume = "auto"

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A lychee sweep's directory gathers its trials (each in a directory of its own that the sweeper claims)
        and its study files, and a sweep continues there: only an input in or around it is refused. Any other
        sweeper writes its jobs to <sweep dir>/<job number>: an earlier sweep's jobs there are refused."""
        global _sweep_lock
        spec = str(OmegaConf.select(config, "hydra.sweep.dir"))
        key = "hydra.sweep.dir"
        try:
            target = _own_directory(spec, key, _inputs(config), "a sweep")
            refuse_ground(spec, target, key)
            writable_parent(spec, target.parent, key)
            if target.exists() and read_only(target):
                raise UserError(f"{key}={spec}: {target} is not writable")
            if not _lychee_sweeper(config):
                lock = OutputLock(target, f"{key}={spec}").acquire()
                try:
                    _refuse_earlier_jobs(spec, target, key)
                except BaseException:
                    lock.release()
                    raise
                _sweep_lock = lock
        except UserError as err:
            raise RunDirRefused(str(err)) from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        release_sweep_dir()


def release_sweep_dir() -> None:
    global _sweep_lock
    lock, _sweep_lock = _sweep_lock, None
    if lock is not None:
        lock.release()


def restarted() -> bool:
    """This process is a restart of its job (a SLURM requeue, an elastic restart)."""
    return any(int(os.environ.get(v) or 0) > 0 for v in RESTART_VARS)


def job_identity() -> str | None:
    """The job this process belongs to, the same across its restarts (None outside a scheduler or torchrun)."""
    for var in JOB_VARS:
        value = os.environ.get(var)
        if value and value != "none":
            return f"{var}={value}"
    return None


def claim_run_dir(spec: str, *, resume: str, overwrite: bool, inputs, restarted: bool = False) -> bool:
    """Checks the run directory against the policy and locks it; raises UserError with the one line. Returns
    whether the claim continues this job's own run after a restart (the caller resumes it from its checkpoint)."""
    global _claim
    target = _own_directory(spec, KEY, inputs, "a run")
    writable_parent(spec, target.parent, KEY)
    lock = OutputLock(target, f"{KEY}={spec}").acquire()
    try:
        clean_leftovers(target)
        _recover_replaced(target)
        _recover_kept(target)
        set_aside, continued = _decide(spec, target, resume, overwrite, restarted)
        held = _run_files(target)
        kept = _keep(target) if held and (continued or _continues(target, resume)) else None
    except BaseException:
        lock.release()
        raise
    _claim = _Claim(target, spec, lock, set_aside, kept)
    atexit.register(finish_run_dir, False)  # a process that ends without main()'s word: as a failed run
    return continued


def _own_directory(spec: str, key: str, inputs, what: str) -> Path:
    """The resolved directory of a run or a sweep (`what`), or one line: it must not be, hold or lie inside an
    input, lie inside a model directory, a dataset or another run (a sweep's directory may hold runs of its own),
    nor be a file."""
    target = output_target(spec, key, directory=True)
    refuse_inputs(spec, target, inputs, key)
    around = refuse_protected(spec, target, key)
    if around is not None and directory_kind(around) == RUN_DIR:
        raise UserError(f"{key}={spec} is inside the run directory {around}: {what}'s directory is its own")
    if target.exists() and not target.is_dir():
        raise UserError(f"{key}={spec}: {target} is a file; {what} writes a directory")
    return target


def commit_run_dir(output_dir: Path) -> None:
    """Every check of the job has passed: the run may change from here on. A continued run's kept files go, and
    the directory gets the marker of a run (a new run, an earlier one without it, a sweep's trial or -m job that no
    claim saw). Until now a directory holding only Hydra's files counted as empty: a run that never got past its
    checks left nothing to protect."""
    claim = _claim
    if claim is not None and claim.kept is not None:
        shutil.rmtree(claim.kept, ignore_errors=True)
        claim.kept = None
    if not (output_dir / RUN_MARKER).exists():
        _mark(output_dir)


def finish_run_dir(finished: bool) -> None:
    """At the end of the job: the lock let go; with overwrite=true the old run deleted (the new one finished) or put
    back (it did not: the failed attempt is kept beside it, hidden, for its logs); a continued run whose checks did
    not pass gets back what Hydra changed."""
    global _claim
    claim, _claim = _claim, None
    if claim is None:
        return
    try:
        if claim.kept is not None:
            _put_kept_back(claim.kept, claim.target)
        if claim.set_aside is not None and finished:
            shutil.rmtree(claim.set_aside, ignore_errors=True)
        elif claim.set_aside is not None:
            failed = _put_back(claim.set_aside, claim.target)
            log.error(
                "overwrite=true: the new run did not finish; %s holds the earlier run again (the failed attempt is "
                "in %s)",
                claim.spec,
                failed,
            )
    finally:
        claim.lock.release()


def _continues(target: Path, resume: str) -> bool:
    return resume == "auto" or (resume not in ("never", "auto") and target in Path(resume).resolve().parents)


def _decide(spec: str, target: Path, resume: str, overwrite: bool, restarted: bool) -> tuple[Path | None, bool]:
    """(where the old run was set aside, whether this job's own run continues after a restart)."""
    held = _run_files(target)
    continues = _continues(target, resume)
    if overwrite and continues:
        raise UserError(f"overwrite=true starts {KEY}={spec} anew, trainer.resume={resume} continues it: choose one")
    if not held:
        return None, False
    shown = listed(held)
    marker = read_json(target / RUN_MARKER)
    if not marker and not (target / ".hydra").is_dir():
        raise UserError(
            f"{KEY}={spec} holds files that are not a lychee_exp run ({shown}): a run writes into a new directory "
            "or its own; choose another"
        )
    finished = any(name in held for name in FINISHED)
    if restarted and marker.get("job") is not None and marker.get("job") == job_identity():
        if finished:
            raise RunAlreadyFinished(f"{KEY}={spec}: this job finished the run before it was restarted; left as it was")
        return None, True
    if continues:
        if finished and not _has_checkpoint(target):
            raise UserError(
                f"{KEY}={spec} holds a finished run ({shown}) with no checkpoint to continue from: "
                "trainer.resume=auto would train it again from scratch; overwrite=true replaces it, or write elsewhere"
            )
        return None, False
    if not overwrite:
        raise UserError(
            f"{KEY}={spec} already holds a run ({shown}): trainer.resume=auto continues it, overwrite=true "
            "replaces it once the new run has finished, or choose another directory"
        )
    refuse_ground(spec, target, KEY)
    if not marker:
        raise UserError(
            f"{KEY}={spec} has no {RUN_MARKER} (written by every lychee_exp run since it was added): overwrite=true "
            "replaces only a directory that carries it; delete the directory yourself, or choose another"
        )
    if foreign := [name for name in held if name not in RUN_NAMES]:
        raise UserError(f"{KEY}={spec} holds files a run does not write ({listed(foreign)}): not replaced")
    if read_only(target):
        raise UserError(f"{KEY}={spec} is read-only: not replaced (make it writable to let overwrite=true replace it)")
    aside = companion(target, REPLACED)
    os.replace(target, aside)  # Hydra creates the directory afresh; the old run waits here until the new one ends
    return aside, False


def _mark(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json_atomic(
        target / RUN_MARKER,
        {"what": "a lychee_exp training run", "created": stamp, "host": socket.gethostname(), "job": job_identity()},
    )


def _keep(target: Path) -> Path:
    """Before Hydra rewrites a continued run's `.hydra/` and appends to its log: a copy of the one and the length
    of the other, beside the run, to put back if the job's checks fail."""
    kept = companion(target, KEPT)
    kept.mkdir()
    if (target / ".hydra").is_dir():
        shutil.copytree(target / ".hydra", kept / ".hydra", copy_function=shutil.copy2)
    logs = {p.name: p.stat().st_size for p in target.glob("*.log") if p.is_file()}
    write_json_atomic(kept / "logs.json", logs)
    return kept


def _put_kept_back(kept: Path, target: Path) -> None:
    lengths = read_json(kept / "logs.json")
    for path in target.glob("*.log"):
        if path.name in lengths:
            os.truncate(path, lengths[path.name])
        else:
            path.unlink()  # started by the attempt whose checks failed
    if (kept / ".hydra").is_dir():
        shutil.rmtree(target / ".hydra", ignore_errors=True)
        os.replace(kept / ".hydra", target / ".hydra")
    shutil.rmtree(kept, ignore_errors=True)


def _recover_kept(target: Path) -> None:
    """A continued run's kept files left by a process killed during its checks: put back. Only called under
    target's lock, which the kept files' owner held for as long as they existed: that owner is gone."""
    for kept in sorted(target.parent.glob(f".{short_name(target)}.{KEPT}-*")):
        _put_kept_back(kept, target)
        log.warning("%s: a continued run was killed during its checks; its files are as they were", target)


def check_resumed_model(resume: str, output_dir: Path, model: dict) -> None:
    """trainer.resume with another model than the checkpoint's run (its config.yaml) is one line here, before any rank
    starts, instead of a rank failing on the checkpoint's weights. Keys that decide which weights exist compare."""
    if resume == "never":
        return
    run = output_dir if resume == "auto" else Path(resume).resolve().parent.parent
    if resume == "auto" and not _has_checkpoint(run):
        return
    try:
        earlier = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=False).get("model", {})
    except Exception:  # no readable config of that run: the checkpoint's own check (in the ranks) decides
        return
    for key in WEIGHT_KEYS:
        before, now = _select(earlier, key), _select(model, key)
        if before is not None and str(before) != str(now):
            raise UserError(
                f"trainer.resume={resume}: the checkpoint's run ({run / 'config.yaml'}) trained model.{key}={before}, "
                f"this run has model.{key}={now}: resume with the same model, or start a new run elsewhere"
            )


def _select(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _recover_replaced(target: Path) -> None:
    """A run that overwrite=true replaced, left aside by a process killed before the new run's end (SIGKILL, a lost
    node): back in place, unless the new run had finished (killed while deleting the old one)."""
    for aside in sorted(target.parent.glob(f".{short_name(target)}.{REPLACED}-*")):
        if (target / "metrics.json").exists():
            shutil.rmtree(aside, ignore_errors=True)
            continue
        _put_back(aside, target)
        log.warning("%s: an overwrite=true run was killed before it finished; the run it replaced is back", target)


def _put_back(aside: Path, target: Path) -> Path:
    """The replaced run back in place; the unfinished new one kept beside it, hidden, for its logs."""
    failed = target.parent / f".{short_name(target)}.failed"
    shutil.rmtree(failed, ignore_errors=True)
    if target.exists():
        os.replace(target, failed)
    os.replace(aside, target)
    return failed


def _run_files(target: Path) -> list[str]:
    """What the directory holds besides what Hydra writes for any job started in it (.hydra/, its log) and the
    marker."""
    if not target.is_dir():
        return []
    return sorted(
        e.name
        for e in target.iterdir()
        if e.name not in (".hydra", RUN_MARKER) and not (e.suffix == ".log" and e.is_file())
    )


def _has_checkpoint(target: Path) -> bool:
    return any((target / "checkpoints").glob("step_*"))


def _lychee_sweeper(config: DictConfig) -> bool:
    return "lychee_optuna_sweeper" in str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))


def _refuse_earlier_jobs(spec: str, target: Path, key: str) -> None:
    if not target.is_dir():
        return
    held = sorted(e.name for e in target.iterdir() if not e.name.startswith(".") and e.name not in SWEEP_OWN)
    if held:
        whose = "an earlier sweep's jobs" if all(directory_kind(target / name) == RUN_DIR for name in held) else "files"
        raise UserError(
            f"{key}={spec} holds {whose} ({listed(held)}): this sweep would write its jobs 0, 1, ... over them; "
            "choose a new hydra.sweep.dir (the default is new for every sweep)"
        )


def _inputs(config: DictConfig) -> list[tuple[str, str]]:
    found = []
    for key in INPUT_KEYS:
        try:
            spec = OmegaConf.select(config, key, default=None)
            if spec:
                found.append((f"{key}={spec}", str(resolve_path(str(spec), key, must_exist=False))))
        except Exception:  # an interpolation or package that does not resolve: the job's own checks name it
            continue
    return found
