"""A training run's directory (hydra.run.dir) under the output policy of every command (docs/outputs.md): a
finished run is never replaced by default, no run writes into one of its inputs, and two runs never share one.

Checked and claimed in the Hydra process by a Hydra callback (`RunDirGuard.on_run_start`, registered in
conf/config.yaml), which runs after the config has composed and BEFORE Hydra creates the directory and writes its
`.hydra/` files and log there: the check must come before anything of a finished run is overwritten.
- A directory that holds a run (anything besides Hydra's own `.hydra/` and log) is refused in one line unless the
  command says what to do with it: `trainer.resume=auto` continues it (from its newest checkpoint; a finished run
  without one is refused, since it would be trained again from scratch), `overwrite=true` replaces it, whole,
  once the new run has finished (until then the old run waits beside it, hidden; a failed or interrupted new run
  puts it back).
- The run directory must not be, hold, or lie inside an input (model.path, the data files, the dataset).
- The main process locks it (core.output_lock) for the whole job: a second run into it is refused at once.
Other processes of the same job (torchrun ranks other than 0, SLURM nodes other than the first, an elastic or
SLURM restart of this very job) neither check nor lock: the directory is theirs.
Sweep trials get fresh directories from the sweeper (lychee_exp.sweep.trials claims each one).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lychee_exp.core.errors import UserError
from lychee_exp.core.output_lock import OutputLock, short_name
from lychee_exp.core.outputs import clean_leftovers, companion, listed, output_target, refuse_inputs, writable_parent
from lychee_exp.core.resources import resolve_path
from lychee_exp.launch.cluster import is_main_process

log = logging.getLogger("lychee_exp")
KEY = "hydra.run.dir"
FINISHED = ("metrics.json", "model")  # what only a run that ended writes
WEIGHT_KEYS = ("path", "kind", "lora.enabled", "lora.r", "lora.target_modules")  # which weights a model has
INPUT_KEYS = ("model.path", "data.train_file", "data.dev_file", "data.dataset")
RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # > 0: this job's own directory, again
REPLACED = "replaced"  # overwrite=true: `.<short name>.replaced-<pid>-*`, the old run until the new one finished


@dataclass
class _Claim:
    target: Path
    spec: str
    lock: OutputLock
    set_aside: Path | None  # overwrite=true: the old run, until the new one has finished


_claim: _Claim | None = None


class RunDirRefused(BaseException):
    """The run directory's one line. A BaseException, because Hydra turns an Exception raised by a callback into a
    warning and goes on (hydra/_internal/callbacks.py); run.main says the line and exits 2."""


class RunDirGuard(Callback):
    """Hydra callback: checks and claims hydra.run.dir before Hydra writes into it (single runs; not sweeps)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_main_process() or any(int(os.environ.get(v) or 0) > 0 for v in RESTART_VARS):
            return
        try:
            claim_run_dir(
                str(OmegaConf.select(config, KEY)),
                resume=str(OmegaConf.select(config, "trainer.resume", default="never")),
                overwrite=bool(OmegaConf.select(config, "overwrite", default=False)),
                inputs=_inputs(config),
            )
        except UserError as err:
            raise RunDirRefused(str(err)) from None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep's directory gathers its trials (each in a directory of its own that the sweeper claims) and its
        study files, and a sweep continues there: only an input in or around it is refused."""
        spec = str(OmegaConf.select(config, "hydra.sweep.dir"))
        try:
            refuse_inputs(
                spec, output_target(spec, "hydra.sweep.dir", directory=True), _inputs(config), "hydra.sweep.dir"
            )
        except UserError as err:
            raise RunDirRefused(str(err)) from None


def claim_run_dir(spec: str, *, resume: str, overwrite: bool, inputs) -> None:
    """Checks the run directory against the policy and locks it; raises UserError with the one line."""
    global _claim
    target = output_target(spec, KEY, directory=True)
    refuse_inputs(spec, target, inputs, KEY)
    if target.exists() and not target.is_dir():
        raise UserError(f"{KEY}={spec}: {target} is a file; a run writes a directory")
    writable_parent(spec, target.parent, KEY)
    lock = OutputLock(target, f"{KEY}={spec}").acquire()
    try:
        clean_leftovers(target)
        _recover_replaced(target)
        set_aside = _decide(spec, target, resume, overwrite)
    except BaseException:
        lock.release()
        raise
    _claim = _Claim(target, spec, lock, set_aside)
    atexit.register(finish_run_dir, False)  # a process that ends without main()'s word: as a failed run


def finish_run_dir(finished: bool) -> None:
    """At the end of the job: the lock let go; with overwrite=true the old run deleted (the new one finished) or put
    back (it did not: the failed attempt is kept beside it, hidden, for its logs)."""
    global _claim
    claim, _claim = _claim, None
    if claim is None:
        return
    try:
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


def _decide(spec: str, target: Path, resume: str, overwrite: bool) -> Path | None:
    held = _run_files(target)
    continues = resume == "auto" or (resume not in ("never", "auto") and target in Path(resume).resolve().parents)
    if overwrite and continues:
        raise UserError(f"overwrite=true starts {KEY}={spec} anew, trainer.resume={resume} continues it: choose one")
    if not held:
        return None
    shown = listed(held)
    if continues:
        if any(name in held for name in FINISHED) and not _has_checkpoint(target):
            raise UserError(
                f"{KEY}={spec} holds a finished run ({shown}) with no checkpoint to continue from: "
                "trainer.resume=auto would train it again from scratch; overwrite=true replaces it, or write elsewhere"
            )
        return None
    if not overwrite:
        raise UserError(
            f"{KEY}={spec} already holds a run ({shown}): trainer.resume=auto continues it, overwrite=true "
            "replaces it once the new run has finished, or choose another directory"
        )
    aside = companion(target, REPLACED)
    os.replace(target, aside)  # Hydra creates the directory afresh; the old run waits here until the new one ends
    return aside


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
    """What the directory holds besides what Hydra writes for any job started in it (.hydra/, its log)."""
    if not target.is_dir():
        return []
    return sorted(e.name for e in target.iterdir() if e.name != ".hydra" and not (e.suffix == ".log" and e.is_file()))


def _has_checkpoint(target: Path) -> bool:
    return any((target / "checkpoints").glob("step_*"))


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
