"""lychee_exp: train and sweep Lychee-style rerankers with Hydra, on one device or many.

Layers, lower to higher (a module imports its own layer or lower ones only; tests/test_layering.py checks it):
core < tracking < sweep < recipe < launch < job < the entry points (run, report, dashboard) < testing < bench.
"""

import os as _os
import signal as _signal

# A DDP rank that launch.launcher.run_ranks is starting (it sets this variable): Ctrl-C reaches every process of
# the terminal's group, and the launcher forwards it too. The rank ends at once with the shell's code for SIGINT and
# no traceback (one still importing torch would print one straight onto the terminal); the launcher stops the
# others and says the one line. Here, as the rank's first import of this package runs, to cover those imports.
if _os.environ.get("LYCHEE_RANK_QUIET_CTRL_C") == "1":
    _signal.signal(_signal.SIGINT, lambda signum, frame: _os._exit(128 + _signal.SIGINT))
    # tqdm's default lock is a multiprocessing semaphore, which a rank ended by a signal leaves to the resource
    # tracker (a "leaked semaphore" warning after the one line); a rank's bars need a thread lock only
    import threading as _threading

    from tqdm import tqdm as _tqdm

    _tqdm.set_lock(_threading.RLock())
