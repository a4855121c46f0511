"""Where a command's results go (`out=`, `--out`, a training run's directory), written so that nothing the user has
is lost. The policy, for every command, is stated once in docs/outputs.md; this module carries it out.

- The command writes into a fresh hidden directory beside out= (`.<name>.<hash>.tmp-<pid>-*`), moved into place
  when the command ends: an interrupted or failed run leaves the previous results as they were, never a
  half-written result. A file output (mine's JSONL) is written inside that directory too, then renamed over out=.
  The results get the permissions the user's umask gives, as any file the user writes.
- An out= that already holds results is refused unless overwrite=true; even then the old results are replaced only
  once the new ones are complete, and a directory holding anything the command does not write is never replaced,
  nor is a read-only one (no write bit: also for root, who may write anything).
- An out= that is an input, holds one, or lies inside an input directory (a model directory, a dataset) is refused;
  so is one inside any model directory or dataset, whether the command reads it or not. Inside a training run's or
  a sweep's directory an output may be added, but no flag replaces a file there or a directory the run writes for
  itself (a command's own earlier output directory there follows the usual rules). The current directory,
  one that holds it, the home directory and / are never an output directory (replacing them would pull the
  ground from under the user's shell).
- out= is locked (io.lock) for the whole command: a second command on the same out= is refused at once.
  Holding the lock proves that hidden staging directories of out= left by a process that is gone (SIGKILL) are
  stale: they are removed, and results a killed move had set aside are put back.
- Every problem with the path (empty, a pkg:// or URL, a trailing slash where a file is written, a name longer than
  the file system takes, a file where a directory is expected, a parent that cannot be created) is one UserError,
  raised before the command reads or scores anything. A full disk (or any storage error) while writing is one
  RunFailed line; the staging directory goes, the earlier results stay.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

from lychee_exp.errors import STOP_SIGNALS, RunFailed, UserError, storage_error, storage_line
from lychee_exp.io.lock import OutputLock, lock_path, short_name

Inputs = Sequence[tuple[str, str]]  # (what it is, as the user named it: "first_stage=run:x.trec", path)
# every command's --help ends with this line
POLICY_LINE = (
    "Outputs: written whole or not at all, never over an input; earlier results only when told (docs/outputs.md)."
)
# a directory input protects what it holds when it is one (a model directory, a BEIR dataset): a wrong path such as
# `dense.model=/` is not one, and the command's own check names it
INPUT_DIR_MARKERS = ("config.json", "corpus.jsonl")
# what makes a directory a model directory for outputs that are not reading it: a config beside weights, adapter,
# tokenizer or card (a lone config.json is any project's)
MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "adapter_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "lychee_reranker.json",
)
# written into every training run's directory when the run claims it (lychee_exp.job.run_dir): what overwrite=true
# may replace is a directory carrying it
RUN_MARKER = ".lychee_run.json"
# every name a run writes into its directory (the job, the ranks, the loggers): overwrite=true replaces a run that
# holds nothing else, and no other command's output replaces one of them
RUN_NAMES = frozenset(
    {
        RUN_MARKER,
        ".hydra",
        "config.yaml",
        "metrics.json",
        "metrics.csv",
        "model",
        "checkpoints",
        "logs",
        "wandb",
        "tensorboard",
    }
)
SWEEP_FILES = ("multirun.yaml", "optimization_results.yaml")  # what a sweep (Hydra's or lychee's) writes first
STAGING, SET_ASIDE = "tmp", "old"  # the hidden companions of an output: `.<short name>.<kind>-<pid>-<random>`
NAME_MAX, PATH_MAX = 255, 4096  # bytes: Linux's limits, where the file system does not say its own

__all__ = [
    "POLICY_LINE",
    "lock_path",
    "resolved",
    "output_target",
    "refuse_inputs",
    "refuse_protected",
    "staged_output",
    "staged_directory",
    "interrupted_line",
]


def resolved(spec: str) -> Path:
    """An absolute path with its symlinks resolved, so that two spellings of one file compare equal."""
    return Path(os.path.abspath(Path(spec).expanduser())).resolve()


def output_target(spec: str, key: str, directory: bool) -> Path:
    """The resolved path of an output as the user wrote it, or one line saying why it cannot be one."""
    written = "directory" if directory else "file"
    if not str(spec).strip():
        raise UserError(f"{key}= is empty: name the {written} to write")
    if "://" in str(spec):
        raise UserError(f"{key}={spec}: an output is a local path (pkg:// names a package's read-only files)")
    if not directory and str(spec).endswith(("/", os.sep)):
        raise UserError(f"{key}={spec} ends with '/', but this command writes a file: name the file")
    target = resolved(spec)
    check_name_lengths(spec, target, key)
    return target


def check_name_lengths(spec: str, target: Path, key: str) -> None:
    """One line for a path the file system cannot take (ENAMETOOLONG would otherwise surface mid-command)."""
    existing = next((p for p in target.parents if _exists(p)), Path("/"))
    name_max, path_max = _limit(existing, "PC_NAME_MAX", NAME_MAX), _limit(existing, "PC_PATH_MAX", PATH_MAX)
    for part in target.parts[1:]:
        size = len(os.fsencode(part))
        if size > name_max:
            raise UserError(
                f"{key}={spec}: the name {part[:24]}... is {size} bytes long; this file system takes at most {name_max}"
            )
    if len(os.fsencode(str(target))) >= path_max:
        raise UserError(f"{key}={spec}: the path is longer than this file system takes ({path_max} bytes)")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the file system: not there
        return False


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


@contextlib.contextmanager
def staged_output(
    spec: str,
    *,
    directory: bool,
    overwrite: bool,
    inputs: Inputs,
    results: Sequence[str] = (),
    key: str = "out",
    ours: Callable[[Path], bool] | None = None,
    overwrite_flag: str = "overwrite=true",
) -> Iterator[Path]:
    """Yields where the command writes (a fresh directory, or a file path inside one), and moves it to out= when
    the block ends without an exception. `results`: the names the command writes into a directory output; an
    existing out= holding anything else is not replaced, even with overwrite=true. `ours(path)`: whether an
    existing file output is an earlier result of this very command (a report page), which it replaces without
    being told; `overwrite_flag`: how the command's overwrite option is spelled in the one line."""
    target = output_target(spec, key, directory)
    refuse_inputs(spec, target, inputs, key)
    results_around = refuse_protected(spec, target, key)
    if directory:
        refuse_ground(spec, target, key)
    writable_parent(spec, target.parent, key)
    with OutputLock(target, f"{key}={spec}"):
        clean_leftovers(target)
        earlier = ours is not None and target.is_file() and ours(target)
        if results_around is not None and target.exists() and not earlier and _theirs(target, results_around):
            kind = directory_kind(results_around) or RUN_DIR
            raise UserError(
                f"{key}={spec} is inside {kind} ({results_around}) and exists: the files of a run or a sweep are "
                "never replaced, whatever an overwrite flag says; write elsewhere"
            )
        _check_existing(spec, target, directory, overwrite or earlier, results, key, overwrite_flag)
        staging = _companion(target, STAGING, spec, key)
        try:
            yield staging if directory else staging / target.name
            with no_interrupts():
                move_into_place(staging, target, directory)
        except OSError as err:
            with no_interrupts():
                shutil.rmtree(staging, ignore_errors=True)
            if storage_error(err) is None:
                raise
            raise RunFailed(f"{key}={spec}: {storage_line(err)}; {left_line(spec)}", "crashed") from None
        except RunFailed:
            # a failed DDP run's one line names a rank log inside the staging directory: keep the logs for it
            # (the next command on this out= removes them: their owner is gone)
            with no_interrupts():
                if not any(staging.iterdir()):
                    staging.rmdir()
            raise
        except BaseException:
            with no_interrupts():
                shutil.rmtree(staging, ignore_errors=True)
            raise


def interrupted_line(spec: str) -> str:
    """What Ctrl-C (or SIGTERM) left: the previous results, or nothing (the temporary directory is gone already)."""
    return f"interrupted; {left_line(spec)}"


def left_line(spec: str) -> str:
    """What a command that stopped left at its output: the previous results, or nothing."""
    try:
        exists = bool(str(spec).strip()) and resolved(spec).exists()
    except OSError:  # a name the file system cannot take: nothing was written there
        exists = False
    return f"{spec} left as it was" if exists else f"nothing written to {spec}"


def refuse_inputs(spec: str, target: Path, inputs: Inputs, key: str) -> None:
    """One line if the output is an input, holds one, or lies inside an input directory."""
    sources = [(what, resolved(path)) for what, path in inputs]
    sources = [(what, source) for what, source in sources if source.exists()]
    # the most specific finding first: the very file replaced, then one held, then the input directory around out=
    for what, source in sources:
        if source == target:
            raise UserError(f"{key}={spec} would replace {source}, an input of this command ({what})")
    for what, source in sources:
        if target in source.parents:
            raise UserError(f"{key}={spec} holds {source}, an input of this command ({what}): write elsewhere")
    for what, source in sources:
        if source in target.parents and any((source / marker).is_file() for marker in INPUT_DIR_MARKERS):
            raise UserError(f"{key}={spec} is inside {source}, an input of this command ({what}): write elsewhere")


def refuse_protected(spec: str, target: Path, key: str) -> Path | None:
    """One line if the output lies inside a model directory or a dataset (inputs of other commands, whether this
    one reads them or not); returns the innermost run or sweep directory around it, if any: an output may be added
    there, but nothing of the run or sweep replaced."""
    results_around = None
    for parent in target.parents:
        kind = directory_kind(parent)
        if kind in (MODEL_DIR, DATASET):
            raise UserError(f"{key}={spec} is inside {parent}, {kind}: write elsewhere")
        if kind in (RUN_DIR, SWEEP_DIR) and results_around is None:
            results_around = parent
    return results_around


MODEL_DIR, DATASET, RUN_DIR, SWEEP_DIR = "a model directory", "a dataset", "a run directory", "a sweep directory"


def _theirs(target: Path, around: Path) -> bool:
    """Whether an existing output inside a run's or a sweep's directory may be theirs: any file (a file carries no
    sign of which command wrote it), and a directory a run writes for itself. An earlier output directory of a
    command (rerank's into <run>/test) is replaced under the usual rules: only with the flag, and only when it
    holds nothing but that command's results."""
    return target.is_file() or (target.parent == around and target.name in RUN_NAMES) or bool(directory_kind(target))


def directory_kind(path: Path) -> str | None:
    """What a directory is to this policy: a model directory, a dataset, a training run's or a sweep's directory, or
    nothing."""
    if (path / "config.json").is_file() and any((path / name).exists() for name in MODEL_FILES):
        return MODEL_DIR
    if (path / "corpus.jsonl").is_file():
        return DATASET
    if (path / RUN_MARKER).is_file() or (path / ".hydra" / "config.yaml").is_file():
        return RUN_DIR
    if any((path / name).is_file() for name in SWEEP_FILES):
        return SWEEP_DIR
    return None


def refuse_ground(spec: str, target: Path, key: str) -> None:
    """One line if a directory output is where the user stands: the current directory or one that holds it, the home
    directory or the root. A directory output is replaced whole at the end, which would leave the user's shell in a
    deleted directory (and overwrite=true would set their files aside)."""
    cwd = resolved(".")
    home = resolved("~")
    if target == cwd or target in cwd.parents:
        where = "the current directory" if target == cwd else "a directory that holds the current one"
        raise UserError(f"{key}={spec} is {where}: an output directory is a directory of its own; name a new one")
    if target in (home, Path(target.anchor)):
        raise UserError(
            f"{key}={spec} is {'the home directory' if target == home else 'the root'}: name a new directory"
        )


def writable_parent(spec: str, parent: Path, key: str) -> None:
    blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UserError(f"{key}={spec}: {blocker} is a file, not a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{key}={spec}: cannot create {parent} ({err.strerror})") from None
    if not os.access(parent, os.W_OK) or read_only(parent):
        raise UserError(f"{key}={spec}: {parent} is not writable")


def read_only(path: Path) -> bool:
    """No write bit at all: the user's way of protecting a file or directory, which root's access ignores."""
    return not path.stat().st_mode & 0o222


def clean_leftovers(target: Path) -> None:
    """Removes the hidden staging directories of `target` whose process is gone (killed before it could), and puts
    back results that a killed move had set aside. Only called under target's lock: no live command owns them."""
    prefix = f".{short_name(target)}."
    found = [entry for entry in target.parent.iterdir() if entry.name.startswith(prefix)]
    for entry in sorted(found, key=lambda e: not e.name[len(prefix) :].startswith(SET_ASIDE)):  # set-aside first
        kind, _, owner = entry.name[len(prefix) :].partition("-")
        pid = owner.partition("-")[0]
        if kind not in (STAGING, SET_ASIDE) or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == SET_ASIDE and not target.exists():
            os.replace(entry, target)  # killed between its two renames: the old results, not the unfinished new
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def companion(target: Path, kind: str) -> Path:
    """A hidden path beside target named for its owner (this process), which clean_leftovers and the run directory's
    recovery read back: `.<short name>.<kind>-<pid>-<random>`."""
    return target.parent / f".{short_name(target)}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def listed(names: Sequence[str]) -> str:
    """The first few names of a directory's entries, for a one-line refusal."""
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _companion(target: Path, kind: str, spec: str, key: str) -> Path:
    """A fresh hidden directory beside target, named for its owner, with the permissions of the user's umask (not
    mkdtemp's 0700, which the results would keep once moved into place)."""
    path = companion(target, kind)
    try:
        path.mkdir(mode=0o777)  # minus the umask
    except OSError as err:
        raise UserError(f"{key}={spec}: cannot write in {target.parent} ({err.strerror})") from None
    return path


def _check_existing(
    spec: str, target: Path, directory: bool, overwrite: bool, results: Sequence[str], key: str, overwrite_flag: str
) -> None:
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
        raise UserError(f"{key}={spec} already holds results ({listed(held)}): set {overwrite_flag} to replace them")
    if read_only(target):
        raise UserError(
            f"{key}={spec} is read-only: not replaced (make it writable to let {overwrite_flag} replace it)"
        )
    foreign = [name for name in held if name not in results] if directory else []
    if foreign:
        raise UserError(f"{key}={spec} holds files this command does not write ({listed(foreign)}): not replaced")


@contextlib.contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A fresh hidden directory beside `target` to write into (the permissions of the user's umask), which replaces
    target whole when the block ends (move_into_place: an earlier target stays until then) and is removed when the
    block raises. For a directory written inside an output the command already holds (a run's model/, under the run
    directory's lock): no checks and no lock of its own. What a writer killed before it could left is cleaned
    first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target)
    staging = companion(target, STAGING)
    try:
        staging.mkdir(mode=0o777)  # minus the umask, as target would have been made
        yield staging
        with no_interrupts():  # a half-done swap is the one state that could lose the earlier target
            move_into_place(staging, target, directory=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def move_into_place(staging: Path, target: Path, directory: bool) -> None:
    """Puts a finished staging directory (or the one file in it) in target's place; an earlier directory at target is
    set aside first and deleted only once the new one is in (a failed rename puts it back)."""
    if not directory:
        os.replace(staging / target.name, target)
        staging.rmdir()
        return
    if not target.exists() or not any(target.iterdir()):
        os.replace(staging, target)  # rename(2) replaces an empty directory in one step
        return
    # a directory with the old results: out of the way, the new one in, then the old one deleted
    old = companion(target, SET_ASIDE)
    os.replace(target, old)
    try:
        os.replace(staging, target)
    except OSError:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def no_interrupts() -> Iterator[None]:
    """Ctrl-C and the stop signals are ignored while results move into place or a temporary directory is deleted (a
    half-done move is the one state that could lose results). Only the main thread can change signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
