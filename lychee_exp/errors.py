"""The project's exceptions, and how every command ends on them, in a module that imports nothing heavy, so that any
layer can raise or catch them.

How a command ends (docs/outputs.md, "Stopping a command"), written once for the entry points (run, mine, rerank,
report, dashboard) and the benchmarks: a user mistake is one line and exit 2, a failed run one line and exit 1,
Ctrl-C one line saying what the command's output was left as and exit 130, a stop signal (SIGTERM, SIGHUP, SIGQUIT:
STOP_SIGNALS) the same words naming the signal and exit 128 + its number (143 for SIGTERM), a full disk (or another
storage failure) one line and exit 1. Never a traceback for any of them."""

import errno
import os
import re
import signal
import sys
from typing import Callable

# The signals that stop a command as SIGTERM does: kill or a scheduler's cancel (SIGTERM), a closed terminal or
# dropped ssh session (SIGHUP), Ctrl-\ (SIGQUIT). A signal that was ignored when the command started (nohup's
# SIGHUP) stays ignored.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class UserError(Exception):
    """Bad configuration or input data; the message names the key, or the file and line."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf."""


class RunFailed(RuntimeError):
    """A training job failed; `kind` is diverged | oom | crashed, for sweepers to record."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # picklable with its kind: submitit hands a job's exception back to the sweeper
        return type(self), (str(self), self.kind)


class Preempted(RunFailed):
    """The run stopped on request (a scheduler's signal) after writing a checkpoint; kind is "preempted"."""


class Terminated(KeyboardInterrupt):
    """A stop signal (STOP_SIGNALS) in a command: handled as Ctrl-C is (the command cleans up and says one line
    naming the signal), but exits 128 + the signal's number as a shell reports it (143 for SIGTERM)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def __reduce__(self):
        return type(self), (self.signum,)


# The storage failures said in one line, not a traceback: full disk, quota, file too large, I/O, read-only
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


def storage_error(err: BaseException) -> OSError | None:
    """The storage failure (full disk, quota, I/O error, read-only file system) behind an exception, if one is: the
    exception itself or one it was raised from."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
            return err
        err = err.__cause__ or err.__context__
    return None


def storage_line(err: BaseException) -> str:
    """`No space left on device (writing <file>)`: the storage failure behind err, said in one line."""
    cause = storage_error(err) or err
    strerror = getattr(cause, "strerror", None) or str(cause)
    where = getattr(cause, "filename", None)
    return f"{strerror} (writing {where})" if where else strerror


def write_failure(err: BaseException) -> str | None:
    """Why a write failed, where the OS refused it ("No space left on device"): an OSError's, or that of a Rust
    writer (safetensors, tokenizers), which puts the OS error in its text as "... (os error 28)"; None for any
    other exception (a bug, not the storage)."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    found = re.search(r"\(os error (\d+)\)", str(err)) if isinstance(err, Exception) else None
    return os.strerror(int(found[1])) if found else None


INTERRUPTED, INTERRUPTED_EXIT = "interrupted (Ctrl-C)", 130  # 128 + SIGINT, as a shell reports it


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def command_main(
    command: Callable[[], int | None], interrupted: Callable[[], str], say: Callable[[str], None] = to_stderr
) -> int:
    """Runs command() and returns its exit status (None: 0). A UserError or RunFailed it raises is said as
    `error: <its line>`; Ctrl-C and SIGTERM as interrupted() (what the output was left as, read when it happens:
    io.outputs.interrupted_line), through stop_line. Ctrl-C raises from here on (ctrl_c_raises)."""
    try:
        ctrl_c_raises()
        return command() or 0
    except (UserError, RunFailed) as err:
        say(f"error: {err}")
        return exit_code(err)
    except KeyboardInterrupt as stop:
        say(stop_line(stop, interrupted()))
        return stop_code(stop)
    except OSError as err:  # the storage failed outside the output (a cache, a rank's log): one line
        if storage_error(err) is None:
            raise
        say(f"error: {storage_line(err)}")
        return 1


def exit_code(err: UserError | RunFailed) -> int:
    """A user mistake: 2; a failed run: 1."""
    return 2 if isinstance(err, UserError) else 1


def ctrl_c_raises() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt and SIGTERM, SIGHUP or SIGQUIT Terminated (a KeyboardInterrupt),
    which the command turns into its one line after cleaning up (until now lychee_exp/__init__ ended the process at
    once: nothing was written yet). A signal ignored since the start stays ignored (nohup: SIGHUP)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _raise_terminated)


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def stop_line(stop: KeyboardInterrupt, line: str) -> str:
    """The one line of Ctrl-C, or of a stop signal (the same words, naming the signal: `terminated (SIGHUP)`)."""
    if not isinstance(stop, Terminated):
        return line
    return f"terminated ({stop.name})" + line.removeprefix(INTERRUPTED).removeprefix("interrupted")


def stop_code(stop: KeyboardInterrupt) -> int:
    """The shell's exit code of the signal: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP, 131 for SIGQUIT."""
    return 128 + stop.signum if isinstance(stop, Terminated) else INTERRUPTED_EXIT
