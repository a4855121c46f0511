"""Where a command's results go (`out=`), written so that nothing the user has is lost.

- The command writes into a fresh temporary directory beside out= (`.<name>.tmp-*`), moved into place when the
  command ends: an interrupted or failed run leaves the previous results as they were, never a half-written result.
  A file output (mine's JSONL) is written inside that directory too, then renamed over out=.
- An out= that already holds results is refused unless overwrite=true; even then the old results are replaced only
  once the new ones are complete, and a directory holding anything the command does not write is never replaced.
- An out= that is, or holds, one of the command's inputs (the dataset, a run file, the model) is refused.
- out= is locked (an OS file lock, `.<name>.lock` beside it) for the whole command: a second command on the same
  out= is refused at once instead of silently replacing the first one's results.
- Every problem with the path (a file where a directory is expected, a parent that cannot be created, a read-only
  directory) is one UserError, raised before the command reads or scores anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Sequence

from filelock import FileLock, Timeout

from lychee_exp.core.errors import RunFailed, UserError

Inputs = Sequence[tuple[str, str]]  # (what it is, as the user named it: "first_stage=run:x.trec", path)


def lock_path(target: Path) -> Path:
    """The lock file of an output (held while a command writes it)."""
    return target.parent / f".{target.name}.lock"


def resolved(spec: str) -> Path:
    """An absolute path with its symlinks resolved, so that two spellings of one file compare equal."""
    return Path(os.path.abspath(Path(spec).expanduser())).resolve()


@contextlib.contextmanager
def staged_output(
    spec: str, *, directory: bool, overwrite: bool, inputs: Inputs, results: Sequence[str] = (), key: str = "out"
) -> Iterator[Path]:
    """Yields where the command writes (a fresh directory, or a file path inside one), and moves it to out= when
    the block ends without an exception. `results`: the names the command writes into a directory output; an
    existing out= holding anything else is not replaced, even with overwrite=true."""
    target = resolved(spec)
    _refuse_inputs(spec, target, inputs, key)
    _writable_parent(spec, target.parent, key)
    lock = FileLock(lock_path(target), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(f"{key}={spec} is in use by another command (it holds {lock_path(target)})") from None
    try:
        _check_existing(spec, target, directory, overwrite, results, key)
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        except OSError as err:
            raise UserError(f"{key}={spec}: cannot write in {target.parent} ({err.strerror})") from None
        try:
            yield staging if directory else staging / target.name
            with _no_interrupts():
                _move_into_place(staging, target, directory)
        except RunFailed:
            # a failed DDP run's one line names a rank log inside the staging directory: keep the logs for it
            with _no_interrupts():
                if not any(staging.iterdir()):
                    staging.rmdir()
            raise
        except BaseException:
            with _no_interrupts():
                shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        lock.release()


def interrupted_line(spec: str) -> str:
    """What Ctrl-C left: the previous results, or nothing (the temporary directory is gone already)."""
    if resolved(spec).exists():
        return f"interrupted; {spec} left as it was"
    return f"interrupted; nothing written to {spec}"


def _refuse_inputs(spec: str, target: Path, inputs: Inputs, key: str) -> None:
    for what, path in inputs:
        source = resolved(path)
        if not source.exists():
            continue
        if source == target:
            raise UserError(f"{key}={spec} would replace {source}, an input of this command ({what})")
        if target in source.parents:
            raise UserError(f"{key}={spec} holds {source}, an input of this command ({what}): write elsewhere")


def _writable_parent(spec: str, parent: Path, key: str) -> None:
    blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UserError(f"{key}={spec}: {blocker} is a file, not a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{key}={spec}: cannot create {parent} ({err.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise UserError(f"{key}={spec}: {parent} is not writable")


def _check_existing(spec: str, target: Path, directory: bool, overwrite: bool, results: Sequence[str], key: str):
    if not target.exists():
        return
    if directory and not target.is_dir():
        raise UserError(f"{key}={spec}: {target} is a file; this command writes a directory")
    if not directory and target.is_dir():
        raise UserError(f"{key}={spec}: {target} is a directory; this command writes a file")
    held = sorted(entry.name for entry in target.iterdir()) if directory else [target.name]
    if not held:
        return  # an empty directory: nothing to lose
    if not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise UserError(f"{key}={spec} already holds results ({shown}): set overwrite=true to replace them")
    foreign = [name for name in held if name not in results] if directory else []
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise UserError(f"{key}={spec} holds files this command does not write ({shown}): not replaced")


def _move_into_place(staging: Path, target: Path, directory: bool) -> None:
    if not directory:
        os.replace(staging / target.name, target)
        staging.rmdir()
        return
    if not target.exists() or not any(target.iterdir()):
        os.replace(staging, target)  # rename(2) replaces an empty directory in one step
        return
    # a directory with the old results: out of the way, the new one in, then the old one deleted
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old)
    try:
        os.replace(staging, target)
    except OSError:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """Ctrl-C is ignored while results move into place or a temporary directory is deleted (a half-done move is
    the one state that could lose results). Only the main thread can change signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
