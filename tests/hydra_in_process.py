"""A Hydra app's command line run in the test's own process: what `python app.py <argv>` would do, for the
tests whose behaviour is the sweeper's, not the process start (each new process imports hydra, optuna and
SQLAlchemy again: seconds). The exit code, stdout and stderr come back as a subprocess.CompletedProcess, so a
test asserts on them as on a real process; each test file keeps its end-to-end runs as real processes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from hydra.core.global_hydra import GlobalHydra


def run_in_process(main: Callable[[], None], argv: list[str], cwd: Path, capfd, monkeypatch, timeout: float = 300):
    """main() with sys.argv = argv in cwd; its SystemExit is the exit code, output read at the fd (capfd); a
    run past `timeout` seconds raises TimeoutError (as subprocess.run's timeout would end a hung process)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", list(argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored afterwards, whatever main() sets
    environ = dict(os.environ)  # a job's hydra.job.env_set (a trial's LYCHEE_TRIAL) stays in os.environ after it
    root, level = logging.root.handlers[:], logging.root.level
    sigint = signal.getsignal(signal.SIGINT)
    GlobalHydra.instance().clear()
    capfd.readouterr()  # only this run's output
    code, began = 0, time.monotonic()
    alarm = signal.signal(signal.SIGALRM, _timed_out)
    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's own alarm, if any: put back below
    signal.setitimer(signal.ITIMER_REAL, min(timeout, outer) if outer else timeout)
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - began), 0.001) if outer else 0)
        signal.signal(signal.SIGALRM, alarm)
        out, err = capfd.readouterr()
        GlobalHydra.instance().clear()
        # Hydra configured logging for this run (its handlers hold the captured streams): give it back
        for handler in logging.root.handlers[:]:
            if handler not in root:
                logging.root.removeHandler(handler)
                handler.close()
        logging.root.handlers[:], logging.root.level = root, level
        signal.signal(signal.SIGINT, sigint)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(argv, code, out, err)


def _timed_out(signum, frame):
    raise TimeoutError("the in-process run took longer than its timeout")
