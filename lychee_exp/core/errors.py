"""The project's exceptions, in a module that imports nothing heavy, so that any layer can raise or catch them."""

import signal

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
