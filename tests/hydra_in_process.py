"""A Hydra app's command line run in the test's own process: what `python app.py <argv>` would do, for the
tests whose behaviour is the sweeper's, not the process start (each new process imports hydra, optuna and
SQLAlchemy again: seconds). The exit code, stdout and stderr come back as a subprocess.CompletedProcess, so a
test asserts on them as on a real process; each test file keeps its end-to-end runs as real processes.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from hydra.core.global_hydra import GlobalHydra


def run_in_process(main: Callable[[], None], argv: list[str], cwd: Path, capfd, monkeypatch):
    """main() with sys.argv = argv in cwd; its SystemExit is the exit code, output read at the fd (capfd)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", list(argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored afterwards, whatever main() sets
    root, level = logging.root.handlers[:], logging.root.level
    sigint = signal.getsignal(signal.SIGINT)
    GlobalHydra.instance().clear()
    capfd.readouterr()  # only this run's output
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        out, err = capfd.readouterr()
        GlobalHydra.instance().clear()
        # Hydra configured logging for this run (its handlers hold the captured streams): give it back
        for handler in logging.root.handlers[:]:
            if handler not in root:
                logging.root.removeHandler(handler)
                handler.close()
        logging.root.handlers[:], logging.root.level = root, level
        signal.signal(signal.SIGINT, sigint)
    return subprocess.CompletedProcess(argv, code, out, err)
