"""The project's exceptions, in a module that imports nothing heavy, so that any layer can raise or catch them."""


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
    """SIGTERM (kill, a scheduler's cancel) in a command: handled as Ctrl-C is (the command cleans up and says one
    line), but exits 143 (128 + SIGTERM) as a shell reports it."""
