"""The lychee_optuna sweeper: one worker of an Optuna study whose trials are jobs of any Hydra app.

The worker asks the study for a trial whenever it is free, runs it through Hydra's launcher (so each trial is
a normal job in `<sweep dir>/<trial number>`), tells the study the task function's return value (one number,
or one per direction) and rewrites the results. Trials run one at a time per worker; more workers (processes
or machines) sharing the storage make more trials run at once, and none waits for another. When the trials
are lychee_exp jobs (recognised by their config), each also learns its place in the study, so that rank 0 can
report dev metrics and be pruned, and an out-of-memory trial can be retried with half the batch.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from lychee_exp.core.errors import UserError
from lychee_exp.sweep import lychee_job
from lychee_exp.sweep import storage as st
from lychee_exp.sweep.outcome import Outcome, job_outcome
from lychee_exp.sweep.results import write_results
from lychee_exp.sweep.samplers import GRID, build_pruner, build_sampler
from lychee_exp.sweep.space import build_space, legacy_as_params, render

log = logging.getLogger(__name__)
PLOT_EVERY_S = 60  # plots cost seconds (plotly, param importances): at most this often during a sweep


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


class LycheeOptunaSweeperImpl(Sweeper):
    def __init__(
        self,
        sampler: Any,
        direction: Any,
        storage: Optional[str],
        study_name: Optional[str],
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: Any,
        custom_search_space: Optional[str],
        search_space: Any,
        pruner: Any,
        oom_retry: bool,
        heartbeat_interval: int,
        grace_period: Optional[int],
        objectives: Any,
    ) -> None:
        # checked in sweep(), where a mistake can be one line and exit code 2
        self.sampler_spec, self.pruner_spec = _plain(sampler) or {}, _plain(pruner) or {}
        directions = _plain(direction)
        self.directions = [directions] if isinstance(directions, str) else list(directions or [])
        self.storage_url, self.study_name, self.n_trials, self.n_jobs = storage, study_name, n_trials, n_jobs
        self.max_failure_rate, self.params = max_failure_rate, _plain(params) or {}
        self.custom_search_space, self.legacy_search_space = custom_search_space, _plain(search_space)
        self.oom_retry, self.heartbeat_interval, self.grace_period = oom_retry, heartbeat_interval, grace_period
        self.objectives = _plain(objectives)
        self.last_plots = 0.0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    # --------------------------------------------------------------------------------------------- sweep
    def sweep(self, arguments: List[str]) -> Any:
        try:
            self._prepare(arguments)
        except UserError as err:  # a bad sweep config: one line, before any trial, exit 2
            log.error("error: %s", err)
            sys.exit(2)
        done, waiting_logged = 0, False
        self.exhausted = False
        while not self.exhausted:
            st.recover_interrupted(self.study, self.storage, self.me)
            counts = st.tally(self.study)
            if counts.finished >= self.n_trials:
                break
            if counts.failed > self.max_failure_rate * self.n_trials:
                self._write_results(plots=True)
                log.error(
                    "error: %d trials failed, more than max_failure_rate=%g x n_trials=%d (last: %s); see "
                    "%s/trials.csv (raise hydra.sweeper.max_failure_rate to go on)",
                    counts.failed,
                    self.max_failure_rate,
                    self.n_trials,
                    self._last_failure(),
                    self.sweep_dir,
                )
                sys.exit(1)
            if not counts.may_ask(self.n_trials):  # the last trials run elsewhere; they may still die
                if not waiting_logged:
                    log.info("waiting for %d trial(s) running in other workers", counts.running)
                    waiting_logged = True
                time.sleep(min(5, self.heartbeat_interval))
                continue
            waiting_logged = False
            done += self._run_next()
        self._write_results(plots=True)
        counts = st.tally(self.study)
        log.info(
            "study %s: %d/%d trials finished (%d complete, %d pruned, %d failed); this worker ran %d; results in %s",
            self.study.study_name,
            counts.finished,
            self.n_trials,
            counts.complete,
            counts.pruned,
            counts.failed,
            done,
            self.sweep_dir,
        )
        return self.study

    def _prepare(self, arguments: List[str]) -> None:
        """Everything that can be wrong with the sweep config is found here, before the first trial."""
        self._check_settings()
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.space = build_space(self.params, arguments, self.config, self.custom_search_space, parser)
        job_cfg = self._compose_sample()
        self.lychee = lychee_job.is_lychee_job(job_cfg)
        if self.lychee:
            lychee_job.check(job_cfg, list(self.space.distributions), self.directions, self.objectives)
        elif self.objectives:
            raise UserError(
                "hydra.sweeper.objectives names metrics.json keys of lychee_exp jobs; this app's task "
                "function returns its values (a tuple for several directions): remove objectives"
            )
        self.space.try_custom(self.config, self.directions)
        sampler = build_sampler(self.sampler_spec, self.space.grid)
        if self.sampler_spec.get("_target_") == GRID:
            size = math.prod(len(values) for values in self.space.grid().values())
            if size < self.n_trials:
                log.info("the grid has %d points: n_trials %d -> %d", size, self.n_trials, size)
                self.n_trials = size
        pruner = build_pruner(self.pruner_spec)
        if self.n_jobs > 1:
            log.warning(
                "hydra.sweeper.n_jobs=%d: this worker runs one trial at a time; start more workers for "
                "concurrent trials (launch/sweep_workers.sh)",
                self.n_jobs,
            )

        self.sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        self.url = self.storage_url or st.default_url(self.sweep_dir)
        name = self.study_name or self.sweep_dir.name
        self.storage = st.open_storage(self.url, self.heartbeat_interval, self.grace_period)
        self.study = st.open_study(self.storage, name, self.directions, sampler, pruner)
        self.me = st.worker_identity()
        # A resumed study, or a second worker, must not replay the first worker's random draws with the same
        # seed (same params again); a fresh single worker keeps the configured seed, for reproducibility.
        shift = len(self.study.get_trials(deepcopy=False)) + 7919 * int(os.environ.get("LYCHEE_SWEEP_WORKER", 0))
        if shift and self.sampler_spec.get("seed") is not None:
            self.study.sampler = build_sampler(self.sampler_spec, self.space.grid, seed_shift=shift)
        OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")
        log.info(
            "study %s in %s (%s): %d of %d trials finished",
            name,
            st.masked(self.url),
            type(self.study.sampler).__name__,
            sum(1 for t in self.study.get_trials(deepcopy=False) if t.state.is_finished()),
            self.n_trials,
        )

    def _check_settings(self) -> None:
        if self.legacy_search_space:
            raise UserError(
                "hydra.sweeper.search_space was removed from hydra-optuna-sweeper (1.2 deprecated it); "
                f"write it as hydra.sweeper.params: {legacy_as_params(self.legacy_search_space)}"
            )
        if not self.directions or any(d not in ("maximize", "minimize") for d in self.directions):
            raise UserError(f"hydra.sweeper.direction={self.directions}: use maximize or minimize (or a list)")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise UserError(f"hydra.sweeper.max_failure_rate={self.max_failure_rate}: must be in [0, 1]")
        if self.n_trials < 1:
            raise UserError(f"hydra.sweeper.n_trials must be >= 1, got {self.n_trials}")
        if self.n_jobs < 1:
            raise UserError(f"hydra.sweeper.n_jobs must be >= 1, got {self.n_jobs}")
        if self.heartbeat_interval < 1:
            raise UserError(f"hydra.sweeper.heartbeat_interval must be >= 1, got {self.heartbeat_interval}")

    def _compose_sample(self) -> DictConfig:
        """One job config with a value from every distribution, composed as a trial would be: a wrong type
        (e.g. a string for an int key) fails here rather than in every trial."""
        sample = {
            key: d.choices[0] if isinstance(d, CategoricalDistribution) else d.low
            for key, d in self.space.distributions.items()
        }
        try:
            return self.hydra_context.config_loader.load_sweep_config(self.config, self.space.overrides(sample))
        except Exception as err:
            raise UserError(
                f"hydra.sweeper.params: a trial's config does not compose: {str(err).splitlines()[0]}"
            ) from None

    # --------------------------------------------------------------------------------------------- trials
    def _run_next(self) -> int:
        """Asks for a trial and runs it; returns 1 if this worker ran one."""
        with warnings.catch_warnings():  # "heartbeat is supposed to be used with Study.optimize": ours beats
            warnings.simplefilter("ignore", UserWarning)
            trial = self.study.ask(self.space.distributions)
        if not st.within_budget(self.study, trial.number, self.n_trials):
            trial.set_user_attr(st.SURPLUS, True)
            trial.set_user_attr(st.REASON, "surplus: other workers took the last places of n_trials")
            self._tell(trial, state=TrialState.FAIL)
            return 0
        trial_id = st.trial_id(self.storage, self.study.study_name, trial.number)
        with st.Heartbeat(self.storage, trial_id, self.heartbeat_interval):
            trial.set_user_attr(st.WORKER, self.me)
            outcome = self._run_trial(trial, trial_id)
            trial.set_user_attr(st.METRICS, outcome.metrics)
            if outcome.reason:
                trial.set_user_attr(st.REASON, outcome.reason)
            self._tell(trial, values=outcome.values, state=TrialState[outcome.state])
        log.info(
            "trial %d: %s%s",
            trial.number,
            outcome.state,
            f" {outcome.values}" if outcome.values else f" ({outcome.reason})" if outcome.reason else "",
        )
        self._write_results(plots=time.monotonic() - self.last_plots > PLOT_EVERY_S)
        return 1

    def _run_trial(self, trial: Any, trial_id: int) -> Outcome:
        try:
            params = self.space.params(trial, self.config)
        except Exception as err:  # custom_search_space failed for this trial only (its first run passed)
            return Outcome(
                "FAIL", reason=f"config: custom_search_space: {str(err).strip().splitlines()[0]}"[:500], kind="config"
            )
        overrides = self.space.overrides(params) + [f"hydra.sweep.dir={render(str(self.sweep_dir))}"]
        if self.lychee:
            overrides += lychee_job.trial_overrides(
                trial.number, trial_id, self.url, self.study.study_name, self.pruner_spec, len(self.directions) > 1
            )
        log.info("trial %d: %s", trial.number, ", ".join(f"{k}={v}" for k, v in params.items()))
        outcome = self._launch(trial, overrides, str(trial.number))
        if outcome.kind == "oom" and self.oom_retry and self.lychee:
            outcome = self._retry_oom(trial, overrides, outcome)
        return outcome

    def _tell(self, trial: Any, **outcome: Any) -> None:
        try:
            self.study.tell(trial, **outcome)
        except RuntimeError as err:  # Grid/BruteForce samplers call study.stop() once all points are done
            if "Study.stop" not in str(err):
                raise
            log.info("the sampler has covered its whole search space: this worker stops")
            self.exhausted = True  # optuna stored the trial's result before the sampler's hook ran

    def _launch(self, trial: Any, overrides: list[str], name: str) -> Outcome:
        name = _fresh_name(self.sweep_dir, name)
        trial.set_user_attr(st.RUN_DIR, str(self.sweep_dir / name))
        try:
            [job_return] = self.launcher.launch(
                [[*overrides, f"hydra.sweep.subdir={name}"]], initial_job_idx=trial.number
            )
        except Exception as err:  # the job's config did not compose (e.g. a key from custom_search_space)
            return Outcome("FAIL", reason=f"config: {str(err).strip().splitlines()[0]}"[:500], kind="config")
        return job_outcome(job_return, self.sweep_dir / name, len(self.directions), self.objectives)

    def _retry_oom(self, trial: Any, overrides: list[str], outcome: Outcome) -> Outcome:
        retry = lychee_job.oom_retry_overrides(
            overrides, self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        )
        if retry is None:
            return outcome
        overrides, halved = retry
        log.warning(
            "trial %d ran out of memory: retrying once with data.batch_size=%d, trainer.grad_accum_steps=%d",
            trial.number,
            halved["batch_size"],
            halved["grad_accum_steps"],
        )
        trial.set_user_attr("oom_retry", halved)
        return self._launch(trial, overrides, f"{trial.number}-oom-retry")

    def _last_failure(self) -> str:
        failed = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if st.counts(t)]
        return failed[-1].user_attrs.get(st.REASON, "no reason recorded") if failed else "none"

    def _write_results(self, plots: bool) -> None:
        metric = self.objectives or str(self.config.get("optimized_metric", "value"))
        write_results(self.study, self.sweep_dir, self.n_trials, metric, st.masked(self.url), plots=plots)
        if plots:
            self.last_plots = time.monotonic()


def _fresh_name(sweep_dir: Path, name: str) -> str:
    """A directory name not taken yet (a study re-created in an old sweep dir must not overwrite old runs)."""
    candidate, k = name, 1
    while (sweep_dir / candidate).exists():
        k += 1
        candidate = f"{name}-{k}"
    return candidate
