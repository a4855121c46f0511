"""hydra-submitit-launcher's launchers (the `.[slurm]` extra), with a requeue that continues the same run, and the
submitting process's side of the jobs (lychee_exp.launch.slurm_jobs): settings Slurm would refuse are one line
before anything is submitted, a job that ends without a result ends the wait in one line, and the jobs still
running when the user stops the command are cancelled.

When a job is signalled before its time limit or preempted, lychee_exp checkpoints and stops
(lychee_exp.launch.preemption), then submitit calls the launcher's `checkpoint()` and requeues what it returns. The
upstream launcher resubmits the job's overrides as they were; these also pin the run directory the job used (a
timestamped sweep directory would resolve anew in the requeued job) and set trainer.resume=auto.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # no `.[slurm]` extra: Hydra scans this module on every start; hydra/launcher=slurm says so
    LocalLauncher = SlurmLauncher = None

log = logging.getLogger(__name__)
PINNED = ("hydra.sweep.dir", "trainer.resume")


def requeue_overrides(overrides: list[str], sweep_dir: str) -> list[str]:
    kept = [line for line in overrides if line.split("=", 1)[0].lstrip("+~") not in PINNED]
    return [*kept, f"hydra.sweep.dir='{sweep_dir}'", "trainer.resume=auto"]


class _ContinuesRun:
    def checkpoint(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        sweep_dir = str(HydraConfig.get().sweep.dir)  # as this job resolved it
        return super().checkpoint(requeue_overrides(list(sweep_overrides), sweep_dir), *args, **kwargs)


class _WatchesJobs:
    """Checks the settings when the sweeper sets the launcher up (once, before any job), and waits for each job
    through slurm_jobs.job_result instead of submitit's unbounded `results()`."""

    def setup(self, **kwargs: Any) -> None:
        from lychee_exp.launch import slurm_jobs

        super().setup(**kwargs)
        slurm_jobs.say_once_per_sweep()
        slurm_jobs.check_settings(self.params, self._EXECUTOR)
        if self._EXECUTOR == "slurm":
            slurm_jobs.check_slurm_reachable()
            executor = self._executor()._executor  # submitit's SlurmExecutor: its script is the one submitted
            script = executor._make_submission_file_text(executor._submitit_command_str, "check")
            slurm_jobs.check_slurm_accepts(script, self.params)

    def _executor(self) -> Any:
        """submitit's executor with this launcher's parameters, as upstream's launch() builds it."""
        import submitit
        from omegaconf import OmegaConf

        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        init_keys = {"submitit_folder", "max_num_timeout"}
        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k not in init_keys}
        )
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        """Upstream's launch() (hydra-submitit-launcher 1.2), its jobs watched: see the class's docstring."""
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from submitit.core.utils import FailedJobError

        from lychee_exp.errors import RunFailed, UserError
        from lychee_exp.launch import slurm_jobs

        assert self.config is not None and len(job_overrides) > 0
        executor = self._executor()
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        try:
            jobs = executor.map_array(self, *zip(*job_params))
        except FailedJobError as err:  # sbatch refused it after all (the cluster changed since setup's check)
            raise slurm_jobs.sbatch_refusal(str(err), self.params) from None
        slurm_jobs.submitted(jobs)
        # every job is waited for before any failure is raised, so that none is left running unwatched
        results, failures = [], []
        for job in jobs:  # Ctrl-C leaves them in flight: run.main cancels them
            try:
                results.append(slurm_jobs.job_result(job))
            except (RunFailed, UserError) as err:
                failures.append(err)
            slurm_jobs.returned([job])
        if failures:
            raise failures[0]
        return [_said_by_the_command(ret) for ret in results]


class _SaidJobReturn(JobReturn):
    """A failed job's return that raises its error without Hydra's line before it ("Error executing job with
    overrides: [...]", which JobReturn.return_value writes to stderr): the sweeper records a UserError or RunFailed,
    or the command says it as its one line."""

    @property
    def return_value(self) -> Any:
        raise self._return_value


def _said_by_the_command(ret: JobReturn) -> JobReturn:
    from lychee_exp.errors import RunFailed, UserError

    if ret.status != JobStatus.FAILED or not isinstance(ret._return_value, (UserError, RunFailed)):
        return ret
    return _SaidJobReturn(**{field.name: getattr(ret, field.name) for field in dataclasses.fields(ret)})


if SlurmLauncher is not None:

    class RequeueingSlurmLauncher(_ContinuesRun, _WatchesJobs, SlurmLauncher):
        pass

    class RequeueingLocalLauncher(_ContinuesRun, _WatchesJobs, LocalLauncher):
        pass
