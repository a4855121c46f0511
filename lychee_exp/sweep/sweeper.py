"""The lychee_optuna sweeper: one worker of an Optuna study whose trials are jobs of any Hydra app.

The worker's loop: ask the study for trials while places are left, place them (lychee_exp.sweep.placement: in
this process, through Hydra's launcher in batches or slots, or in device-slot workers), take back those that
ended, tell the study each task function's return value (one number, or one per direction) and rewrite the
results. More workers (processes or machines) sharing the storage add more trials in flight. When the trials are
lychee_exp jobs (recognised by their config), each is also handed its TrialContext, so that rank 0 can report dev
metrics and be pruned, and an out-of-memory trial can be retried with half the batch. Fatal lines go to stderr
as `error: ...` (exit 2: a bad sweep config; exit 1: the trials failed).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, List, NoReturn, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.sweep import fixed_config, lychee_trials
from lychee_exp.sweep import storage as st
from lychee_exp.sweep.placement import WORKER_ENV, Placement, SlotsFailed, choose, parse
from lychee_exp.sweep.samplers import GRID, build_pruner, build_sampler
from lychee_exp.sweep.space import build_space, legacy_as_params
from lychee_exp.sweep.sweep_results import write_sweep_results
from lychee_exp.sweep.trials import Pending, TrialRunner, TrialSettings
from lychee_exp.tracking.trial import masked, open_storage

log = logging.getLogger(__name__)
PLOT_EVERY_S = 60  # plots cost seconds (plotly, param importances): at most this often during a sweep


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def fatal(message: str, code: int) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


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
        devices_per_trial: Any = "all",
    ) -> None:
        # checked in sweep(), where a mistake can be one line and exit code 2
        self.sampler_spec, self.pruner_spec = _plain(sampler) or {}, _plain(pruner) or {}
        directions = _plain(direction)
        self.directions = [directions] if isinstance(directions, str) else list(directions or [])
        self.storage_url, self.study_name, self.n_trials, self.n_jobs = storage, study_name, n_trials, n_jobs
        self.max_failure_rate, self.params = max_failure_rate, _plain(params) or {}
        self.custom_search_space, self.legacy_search_space = custom_search_space, _plain(search_space)
        self.oom_retry, self.heartbeat_interval, self.grace_period = oom_retry, heartbeat_interval, grace_period
        self.objectives, self.devices_per_trial = _plain(objectives), devices_per_trial
        self.last_plots = 0.0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    # --------------------------------------------------------------------------------------------- sweep
    def sweep(self, arguments: List[str]) -> None:
        try:
            placement = self._prepare(arguments)
        except UserError as err:  # a bad sweep config: one line, before any trial, exit 2
            fatal(str(err), 2)
        try:
            stop, ran = self._run(placement)
        except SlotsFailed as err:
            fatal(str(err), 1)
        self._conclude(stop, placement.summary(ran))

    def _run(self, placement: Placement) -> tuple[str, int]:
        """ask -> place -> take back the ended -> tell, until the study is done (or too many trials failed) and
        nothing placed here is still in flight. Returns why it stopped and how many trials this worker told."""
        stop, ran, timeout, waiting_logged = None, 0, 0.0, False
        while True:
            for pending in placement.ended(timeout):
                ran += self._told(pending)
            self.recover()
            counts = st.tally(self.study)
            stop = stop or self._stop_reason(counts, placement)
            if stop is not None and not placement.busy:
                return stop, ran
            free = placement.room - placement.busy
            if stop is None and free > 0 and counts.may_ask(self.n_trials):
                left = max(counts.waiting, self.n_trials - counts.finished - counts.running)
                placement.place([p for p in (self._ask() for _ in range(max(1, min(free, left)))) if p])
                timeout, waiting_logged = 0.0, False
                continue
            if not placement.busy and not waiting_logged:  # the last trials run elsewhere; they may still die
                log.info("waiting for %d trial(s) running in other workers", counts.running)
                waiting_logged = True
            timeout = min(5, self.heartbeat_interval)  # wake when a trial ends, or to beat the drum of recovery

    def _stop_reason(self, counts: Any, placement: Placement) -> str | None:
        too_many = counts.failed > self.max_failure_rate * self.n_trials
        if placement.finished:  # device-slot workers ended: their own loops stopped for one of these reasons
            return "failures" if too_many else "done"
        if self.exhausted or counts.finished >= self.n_trials:
            return "done"
        if too_many:
            return "failures"  # no new trial; those in flight finish and are recorded
        return None

    def _conclude(self, stop: str, ran: str) -> None:
        """Final results and the summary line; exit 1 when the failures stopped the sweep or nothing completed."""
        self._write_results(plots=True)
        counts = st.tally(self.study)
        if stop == "failures":
            fatal(
                f"{counts.failed} trials failed, more than max_failure_rate={self.max_failure_rate:g} x "
                f"n_trials={self.n_trials} (last: {st.last_failure(self.study)}); see {self.sweep_dir}/trials.csv "
                "(raise hydra.sweeper.max_failure_rate to go on)",
                1,
            )
        log.info(
            "study %s: %d/%d trials finished (%d complete, %d pruned, %d failed); %s; results in %s",
            self.study.study_name,
            counts.finished,
            self.n_trials,
            counts.complete,
            counts.pruned,
            counts.failed,
            ran,
            self.sweep_dir,
        )
        if counts.finished and counts.failed == counts.finished:
            failed = f"{counts.failed} of {counts.finished}"
            fatal(f"no trial completed: {failed} failed (reasons in {self.sweep_dir}/trials.csv)", 1)

    def _ask(self) -> Pending | None:
        """A new trial set up to run, or None when it took a place other workers had already filled (or one
        of them failed it as unclaimed before this worker claimed it)."""
        with warnings.catch_warnings():  # "heartbeat is supposed to be used with Study.optimize": ours beats
            warnings.simplefilter("ignore", UserWarning)
            trial = self.study.ask()  # its params are drawn once this worker has claimed it (runner.start)
        if not st.within_budget(self.study, trial.number, self.n_trials):
            trial.set_user_attr(st.SURPLUS, True)
            trial.set_user_attr(st.REASON, "surplus: other workers took the last places of n_trials")
            self.tell(trial, state="FAIL")
            return None
        return self.runner.start(trial)

    def _told(self, pending: Pending) -> int:
        self.runner.finish(pending)
        self._write_results(plots=time.monotonic() - self.last_plots > PLOT_EVERY_S)
        return 1

    def tell(self, trial: Any, values: Any = None, state: str = "COMPLETE") -> None:
        try:
            self.study.tell(trial, values=values, state=TrialState[state])
        except RuntimeError as err:  # Grid/BruteForce samplers call study.stop() once all points are done
            if "Study.stop" not in str(err):
                raise
            if not self.exhausted:
                log.info("the sampler has covered its whole search space: no more trials are asked")
            self.exhausted = True  # optuna stored the trial's result before the sampler's hook ran

    # --------------------------------------------------------------------------------------------- set-up
    def _prepare(self, arguments: List[str]) -> Placement:
        """Everything that can be wrong with the sweep config is found here, before the first trial; returns
        where the trials will run."""
        self._check_settings()
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.space = build_space(self.params, arguments, self.config, self.custom_search_space, parser)
        job_cfg = self._compose_sample()
        self.lychee = lychee_trials.is_lychee_job(job_cfg)
        if self.lychee:
            lychee_trials.check(job_cfg, list(self.space.distributions), self.directions, self.objectives)
        elif self.objectives:
            raise UserError(
                "hydra.sweeper.objectives names metrics.json keys of lychee_exp jobs; this app's task "
                "function returns its values (a tuple for several directions): remove objectives"
            )
        searched = [*self.space.distributions, *self.space.try_custom(self.config, self.directions)]
        sampler = build_sampler(self.sampler_spec, self.space.grid)
        if self.sampler_spec.get("_target_") == GRID:
            size = math.prod(len(values) for values in self.space.grid().values())
            if size < self.n_trials:
                log.info("the grid has %d points: n_trials %d -> %d", size, self.n_trials, size)
                self.n_trials = size
        pruner = build_pruner(self.pruner_spec)
        self.sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        self.url = self.storage_url or st.default_url(self.sweep_dir)
        name = self.study_name or self.sweep_dir.name
        storage = open_storage(self.url, self.heartbeat_interval, self.grace_period)
        self.study, existing = st.open_study(storage, name, self.directions, sampler, pruner)
        st.check_search_space(self.study, self.space.distributions, custom=self.space.custom is not None)
        fixed_config.check(self.study, fixed_config.fingerprint(job_cfg, searched, self.lychee), masked(self.url))
        me, self.exhausted = st.worker_identity(), False
        self.recover = st.Recovery(self.study, storage, me)
        # A resumed study, or a second worker, must not replay the first worker's random draws with the same
        # seed (same params again); a fresh single worker keeps the configured seed, for reproducibility.
        shift = len(self.study.get_trials(deepcopy=False)) + 7919 * int(os.environ.get(WORKER_ENV, 0))
        if shift and self.sampler_spec.get("seed") is not None:
            self.study.sampler = build_sampler(self.sampler_spec, self.space.grid, seed_shift=shift)
        # whole: a second worker of the study writes the same file as it starts
        write_text_atomic(self.sweep_dir / "multirun.yaml", OmegaConf.to_yaml(self.config))
        log.info(
            "%s study %s in %s (%s): %d of %d trials finished",
            "resuming" if existing else "new",
            name,
            masked(self.url),
            type(self.study.sampler).__name__,
            sum(1 for t in self.study.get_trials(deepcopy=False) if t.state.is_finished()),
            self.n_trials,
        )
        self.runner = TrialRunner(
            TrialSettings(
                self.launcher,
                self.sweep_dir,
                len(self.directions),
                self.objectives,
                self.oom_retry,
                self.lychee,
                self.hydra_context.config_loader,
                self.config,
                self.space,
                self.study,
                storage,
                self.url,
                me,
                self.heartbeat_interval,
                self.pruner_spec,
                self.tell,
            )
        )
        if not self.space.distributions and self.space.custom is None:
            log.info("nothing to search (no params or sweep overrides): %d trial(s) of the fixed config", self.n_trials)
        sample = self.space.sample_overrides()
        return choose(self.runner, self.n_jobs, self.devices_per_trial, job_cfg, self.n_trials, sample)

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
        for key in ("n_trials", "n_jobs", "heartbeat_interval"):
            if getattr(self, key) < 1:
                raise UserError(f"hydra.sweeper.{key} must be >= 1, got {getattr(self, key)}")
        parse(self.devices_per_trial)

    def _compose_sample(self) -> DictConfig:
        """One job config with a value from every distribution, composed as a trial would be: a wrong type
        (e.g. a string for an int key) fails here rather than in every trial."""
        try:
            return self.hydra_context.config_loader.load_sweep_config(self.config, self.space.sample_overrides())
        except Exception as err:
            raise UserError(
                f"hydra.sweeper.params: a trial's config does not compose: {str(err).splitlines()[0]}"
            ) from None

    def _write_results(self, plots: bool) -> None:
        metric = self.objectives or str(self.config.get("optimized_metric", "value"))
        write_sweep_results(self.study, self.sweep_dir, self.n_trials, metric, masked(self.url), plots=plots)
        if plots:
            self.last_plots = time.monotonic()
