"""lychee_exp: train and sweep Lychee-style rerankers with Hydra, on one device or many.

Packages by concern, lower to higher (a module imports its own package or lower ones only; tests/test_layering.py
checks it, docs/architecture.md draws it): errors < io < config < data < model < parallel < ir < tracking < train <
launch < job < sweep < cli < the entry points (run, mine, rerank, plan, report, dashboard).
"""

import os as _os
import signal as _signal
import sys as _sys

_COMMANDS = ("run", "mine", "rerank")  # the entry points a user starts: python -m lychee_exp.<name>, lychee-<name>
# started as python -m lychee_exp.<name> only; each main hands Ctrl-C back through errors.command_main
_MODULE_COMMANDS = (
    *(f"lychee_exp.{name}" for name in (*_COMMANDS, "report", "dashboard")),
    # the repository's benchmarks (benchmarks/, outside the package), which import lychee_exp first
    "benchmarks",
    *(f"benchmarks.{name}" for name in ("gpu_check", "peers", "own_batching", "sweep_overhead", "sweep_throughput")),
)


def _started_as_command() -> bool:
    argv = getattr(_sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return module in _MODULE_COMMANDS or _os.path.basename(_sys.argv[0]) in {f"lychee-{c}" for c in _COMMANDS}


def _interrupted_while_starting(signum, frame) -> None:
    what = "interrupted (Ctrl-C)" if signum == _signal.SIGINT else f"terminated ({_signal.Signals(signum).name})"
    _sys.stderr.write(f"{what} while starting; nothing written\n")
    _os._exit(128 + signum)


# Ctrl-C, one line and exit 130, never a traceback:
# - a command (run, mine, rerank, report, a benchmark) spends seconds importing torch and transformers before its
#   main() can catch KeyboardInterrupt: until main() hands Ctrl-C back (signal.default_int_handler), it ends the
#   process here.
# - a DDP rank that launch.launcher.run_ranks is starting (it sets the variable): Ctrl-C reaches every process of
#   the terminal's group, and the launcher forwards it too. The rank ends at once, silently, also while it imports;
#   the launcher stops the others and says the one line.
if _os.environ.get("LYCHEE_RANK_QUIET_CTRL_C") == "1":
    _signal.signal(_signal.SIGINT, lambda signum, frame: _os._exit(128 + _signal.SIGINT))
    # tqdm's default lock is a multiprocessing semaphore, which a rank ended by a signal leaves to the resource
    # tracker (a "leaked semaphore" warning after the one line); a rank's bars need a thread lock only
    import threading as _threading

    from tqdm import tqdm as _tqdm

    _tqdm.set_lock(_threading.RLock())
elif _started_as_command() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)
    # kill, a closed terminal, Ctrl-\: the same one line, exit 128 + the signal (one ignored at start, as nohup's
    # SIGHUP, stays ignored)
    for _stop in (_signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT):
        if _signal.getsignal(_stop) is _signal.SIG_DFL:
            _signal.signal(_stop, _interrupted_while_starting)
