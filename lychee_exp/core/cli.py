"""How every command ends (docs/outputs.md, "Stopping a command"), written once for the entry points (run, mine,
rerank, report, dashboard) and the benchmarks: a user mistake is one line and exit 2, a failed run one line and
exit 1, Ctrl-C one line saying what the command's output was left as and exit 130, a stop signal (SIGTERM, SIGHUP,
SIGQUIT: core.errors.STOP_SIGNALS) the same words naming the signal and exit 128 + its number (143 for SIGTERM), a
full disk (or another storage failure) one line and exit 1. Never a traceback for any of them.

Here, below every layer that has a command's main (tracking's report and dashboard, the entry points, bench), so
that no entry point imports another one for it; imports nothing heavy."""

from __future__ import annotations

import signal
import sys
from typing import Callable

from lychee_exp.core.errors import STOP_SIGNALS, RunFailed, Terminated, UserError
from lychee_exp.core.outputs import storage_error, storage_line

INTERRUPTED, INTERRUPTED_EXIT = "interrupted (Ctrl-C)", 130  # 128 + SIGINT, as a shell reports it


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def command_main(
    command: Callable[[], int | None], interrupted: Callable[[], str], say: Callable[[str], None] = to_stderr
) -> int:
    """Runs command() and returns its exit status (None: 0). A UserError or RunFailed it raises is said as
    `error: <its line>`; Ctrl-C and SIGTERM as interrupted() (what the output was left as, read when it happens:
    core.outputs.interrupted_line), through stop_line. Ctrl-C raises from here on (ctrl_c_raises)."""
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
