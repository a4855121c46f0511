"""hydra-submitit-launcher's launchers (the `.[slurm]` extra), with a requeue that continues the same run.

When a job is signalled before its time limit or preempted, lychee_exp checkpoints and stops
(lychee_exp.launch.preemption), then submitit calls the launcher's `checkpoint()` and requeues what it returns. The
upstream launcher resubmits the job's overrides as they were; these also pin the run directory the job used (a
timestamped sweep directory would resolve anew in the requeued job) and set trainer.resume=auto.
"""

from __future__ import annotations

from typing import Any

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # no `.[slurm]` extra: Hydra scans this module on every start; hydra/launcher=slurm says so
    LocalLauncher = SlurmLauncher = None

PINNED = ("hydra.sweep.dir", "trainer.resume")


def requeue_overrides(overrides: list[str], sweep_dir: str) -> list[str]:
    kept = [line for line in overrides if line.split("=", 1)[0].lstrip("+~") not in PINNED]
    return [*kept, f"hydra.sweep.dir='{sweep_dir}'", "trainer.resume=auto"]


class _ContinuesRun:
    def checkpoint(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        sweep_dir = str(HydraConfig.get().sweep.dir)  # as this job resolved it
        return super().checkpoint(requeue_overrides(list(sweep_overrides), sweep_dir), *args, **kwargs)


if SlurmLauncher is not None:

    class RequeueingSlurmLauncher(_ContinuesRun, SlurmLauncher):
        pass

    class RequeueingLocalLauncher(_ContinuesRun, LocalLauncher):
        pass
