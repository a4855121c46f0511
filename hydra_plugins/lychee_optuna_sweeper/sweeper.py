"""LycheeOptunaSweeper: one worker of an Optuna study whose trials are lychee_exp jobs.

The worker asks the study for a trial whenever it is free, runs it through Hydra's launcher (so each trial is
a normal job: its own directory `<sweep dir>/<trial number>`, logs, metrics.json, DDP across all `gpus`), then
tells the study the outcome and rewrites the results. Trials run one at a time per worker; more workers
(processes or machines) sharing the storage make more trials run at once, and none waits for another.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
STORAGE_ENV = "LYCHEE_TRIAL_STORAGE"


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


class LycheeOptunaSweeper(Sweeper):
    def __init__(self, sampler: Any, direction: Any, storage: Optional[str], study_name: Optional[str],
                 n_trials: int, n_jobs: int, max_failure_rate: float, params: Any,
                 custom_search_space: Optional[str], pruner: Any, oom_retry: bool, heartbeat_interval: int,
                 grace_period: Optional[int], objectives: Any) -> None:
        self.sampler_spec, self.pruner_spec = _plain(sampler) or {}, _plain(pruner) or {}
        directions = _plain(direction)
        self.directions = [directions] if isinstance(directions, str) else list(directions)
        self.storage_url, self.study_name, self.n_trials, self.n_jobs = storage, study_name, n_trials, n_jobs
        self.max_failure_rate, self.params = max_failure_rate, _plain(params) or {}
        self.custom_search_space, self.oom_retry = custom_search_space, oom_retry
        self.heartbeat_interval, self.grace_period = heartbeat_interval, grace_period
        self.objectives = _plain(objectives)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    # --------------------------------------------------------------------------------------------- sweep
    def sweep(self, arguments: List[str]) -> Any:
        from lychee_exp.errors import UserError

        try:
            self._prepare(arguments)
        except UserError as err:  # a bad sweep config: one line, before any trial, exit 2 (as run.py does)
            log.error("error: %s", err)
            sys.exit(2)
        from lychee_exp.sweep.storage import recover_interrupted, tally

        done = 0
        waiting_logged = False
        self.exhausted = False
        while not self.exhausted:
            recover_interrupted(self.study, self.storage, self.me)
            counts = tally(self.study)
            if counts.finished >= self.n_trials:
                break
            if counts.failed > self.max_failure_rate * self.n_trials:
                self._write_results()
                log.error("error: %d trials failed, more than max_failure_rate=%g x n_trials=%d; see %s/trials.csv "
                          "(raise hydra.sweeper.max_failure_rate to go on)", counts.failed, self.max_failure_rate,
                          self.n_trials, self.sweep_dir)
                sys.exit(1)
            if not counts.may_ask(self.n_trials):  # the last trials run elsewhere; they may still die
                if not waiting_logged:
                    log.info("waiting for %d trial(s) running in other workers", counts.running)
                    waiting_logged = True
                time.sleep(min(5, self.heartbeat_interval))
                continue
            waiting_logged = False
            done += self._run_next()
        self._write_results()
        counts = tally(self.study)
        log.info("study %s: %d/%d trials finished (%d complete, %d pruned, %d failed); this worker ran %d; "
                 "results in %s", self.study.study_name, counts.finished, self.n_trials, counts.complete,
                 counts.pruned, counts.failed, done, self.sweep_dir)
        return self.study

    def _prepare(self, arguments: List[str]) -> None:
        """Everything that can be wrong with the sweep config is found here, before the first trial."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from lychee_exp.errors import UserError
        from lychee_exp.sweep.pruning import build_pruner
        from lychee_exp.sweep.space import build_space
        from lychee_exp.sweep.storage import default_url, open_storage, open_study, worker_identity

        if any(d not in ("maximize", "minimize") for d in self.directions) or not self.directions:
            raise UserError(f"hydra.sweeper.direction={self.directions}: use maximize or minimize (or a list)")
        if len(self.directions) > 1 and len(self.objectives or []) != len(self.directions):
            raise UserError(f"hydra.sweeper.objectives={self.objectives}: {len(self.directions)} directions need as "
                            "many metrics.json keys, e.g. [ndcg@10, train_time_s]")
        if self.n_trials < 1:
            raise UserError(f"hydra.sweeper.n_trials must be >= 1, got {self.n_trials}")
        if self.heartbeat_interval < 1:
            raise UserError(f"hydra.sweeper.heartbeat_interval must be >= 1, got {self.heartbeat_interval}")
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.space = build_space(self.params, arguments, self.config, self.custom_search_space, parser)
        sampler = self._instantiate("sampler", self.sampler_spec, "optuna.samplers.BaseSampler")
        pruner = self._instantiate("pruner", self.pruner_spec, "optuna.pruners.BasePruner") \
            if self.pruner_spec else build_pruner(None)  # null: never prune
        self._check_composes()
        if self.n_jobs > 1:
            log.warning("hydra.sweeper.n_jobs=%d: this worker runs one trial at a time, each on all gpus; start "
                        "more workers for concurrent trials (launch/sweep_workers.sh)", self.n_jobs)

        self.sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        self.url = self.storage_url or default_url(self.sweep_dir)
        name = self.study_name or self.sweep_dir.name
        self.storage = open_storage(self.url, self.heartbeat_interval, self.grace_period)
        self.study = open_study(self.storage, name, self.directions, sampler, pruner)
        self.me = worker_identity()
        # A resumed study, or a second worker, must not replay the first worker's random draws with the same
        # seed (same params again); a fresh single worker keeps the configured seed, for reproducibility.
        shift = len(self.study.get_trials(deepcopy=False)) + 7919 * int(os.environ.get("LYCHEE_SWEEP_WORKER", 0))
        if shift and self.sampler_spec.get("seed") is not None:
            self.study.sampler = self._instantiate("sampler", {**self.sampler_spec,
                                                               "seed": self.sampler_spec["seed"] + shift}, None)
        OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")
        log.info("study %s in %s: %d of %d trials finished", name, self._masked_url(),
                 sum(1 for t in self.study.get_trials(deepcopy=False) if t.state.is_finished()), self.n_trials)

    def _instantiate(self, key: str, spec: dict, base: Optional[str]) -> Any:
        from hydra.utils import get_class, instantiate

        from lychee_exp.errors import UserError

        target = spec.get("_target_")
        if not _importable(str(target)):
            raise UserError(f"hydra.sweeper.{key}._target_={target}: no such class (e.g. "
                            f"optuna.{key}s.{'TPESampler' if key == 'sampler' else 'MedianPruner'})") from None
        try:
            with warnings.catch_warnings():  # "X is experimental": the user chose X
                warnings.simplefilter("ignore")
                obj = instantiate(dict(spec))
        except Exception as err:
            message = str(err.__cause__ or err).splitlines()[0]  # the cause, e.g. an unexpected keyword
            if "unexpected keyword" in message:  # a new _target_ merged with the old one's arguments
                message += f" (remove it with ~hydra.sweeper.{key}.<argument>)"
            raise UserError(f"hydra.sweeper.{key}: _target_={target}: {message}") from None
        if base and not isinstance(obj, get_class(base)):
            raise UserError(f"hydra.sweeper.{key}._target_={target} is not an {base}")
        return obj

    def _check_composes(self) -> None:
        """One job config with a value from every distribution, composed as a trial would be: a wrong type
        (e.g. a string for data.batch_size) fails here rather than in every trial."""
        from optuna.distributions import CategoricalDistribution

        from lychee_exp.errors import UserError

        sample = {key: d.choices[0] if isinstance(d, CategoricalDistribution) else d.low
                  for key, d in self.space.distributions.items()}
        try:
            self.hydra_context.config_loader.load_sweep_config(self.config, self.space.overrides(sample))
        except Exception as err:
            raise UserError(f"hydra.sweeper.params: a trial's config does not compose: "
                            f"{str(err).splitlines()[0]}") from None

    def _masked_url(self) -> str:
        from lychee_exp.sweep.storage import masked

        return masked(self.url)

    # --------------------------------------------------------------------------------------------- trials
    def _run_next(self) -> int:
        """Asks for a trial and runs it; returns 1 if this worker ran one."""
        from optuna.trial import TrialState

        from lychee_exp.sweep import storage as st

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
            params = self.space.params(trial, self.config)
            overrides = self.space.overrides(params) + self._trial_overrides(trial.number, trial_id)
            log.info("trial %d: %s", trial.number, ", ".join(f"{k}={v}" for k, v in params.items()))
            outcome = self._launch(trial, overrides, str(trial.number))
            if outcome.kind == "oom" and self.oom_retry:
                outcome = self._retry_oom(trial, overrides, outcome)
            trial.set_user_attr(st.METRICS, outcome.metrics)
            if outcome.reason:
                trial.set_user_attr(st.REASON, outcome.reason)
            self._tell(trial, values=outcome.values, state=TrialState[outcome.state])
        log.info("trial %d: %s%s", trial.number, outcome.state,
                 f" {outcome.values}" if outcome.values else f" ({outcome.reason})" if outcome.reason else "")
        self._write_results()
        return 1

    def _tell(self, trial: Any, **outcome: Any) -> None:
        try:
            self.study.tell(trial, **outcome)
        except RuntimeError as err:  # Grid/BruteForce samplers call study.stop() once all points are done
            if "Study.stop" not in str(err):
                raise
            log.info("the sampler has covered its whole search space: this worker stops")
            self.exhausted = True  # optuna stored the trial's result before the sampler's hook ran

    def _trial_overrides(self, number: int, trial_id: int) -> list[str]:
        from lychee_exp.sweep.space import render

        trial = [f"trial.number={number}"]
        if len(self.directions) == 1:  # optuna prunes single-objective studies only
            # the URL may hold a password: it travels in the environment (inherited by the ranks), so that
            # configs, logs and W&B only ever see the variable's name
            os.environ[STORAGE_ENV] = self.url
            trial += [f"trial.storage=env:{STORAGE_ENV}", f"trial.study_name={render(self.study.study_name)}",
                      # ++: a dict merged into the schema's empty one needs force-add
                      f"trial.id={trial_id}", f"++trial.pruner={render(self.pruner_spec)}"]
        return [*trial, f"hydra.sweep.dir={render(str(self.sweep_dir))}"]

    def _launch(self, trial: Any, overrides: list[str], name: str) -> Any:
        from lychee_exp.sweep.outcome import job_outcome
        from lychee_exp.sweep.storage import RUN_DIR

        name = _fresh_name(self.sweep_dir, name)
        trial.set_user_attr(RUN_DIR, str(self.sweep_dir / name))
        try:
            [job_return] = self.launcher.launch([[*overrides, f"hydra.sweep.subdir={name}"]],
                                                initial_job_idx=trial.number)
        except Exception as err:  # the job's config did not compose (e.g. a key from custom_search_space)
            from lychee_exp.sweep.outcome import Outcome

            return Outcome("FAIL", reason=f"config: {str(err).strip().splitlines()[0]}"[:500], kind="config")
        return job_outcome(job_return, self.sweep_dir / name, len(self.directions), self.objectives)

    def _retry_oom(self, trial: Any, overrides: list[str], outcome: Any) -> Any:
        from lychee_exp.sweep.outcome import oom_retry_overrides

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        retry = oom_retry_overrides(overrides, cfg.data.batch_size, cfg.trainer.grad_accum_steps)
        if retry is None:
            return outcome
        log.warning("trial %d ran out of memory: retrying once with data.batch_size=%d, trainer.grad_accum_steps=%d",
                    trial.number, cfg.data.batch_size // 2, cfg.trainer.grad_accum_steps * 2)
        trial.set_user_attr("oom_retry", {"batch_size": cfg.data.batch_size // 2,
                                          "grad_accum_steps": cfg.trainer.grad_accum_steps * 2})
        return self._launch(trial, retry, f"{trial.number}-oom-retry")

    def _write_results(self) -> None:
        from lychee_exp.sweep.results import write_results

        metric = self.objectives or str(self.config.get("optimized_metric", "value"))
        write_results(self.study, self.sweep_dir, self.n_trials, metric, self._masked_url())


def _fresh_name(sweep_dir: Path, name: str) -> str:
    """A directory name not taken yet (a study re-created in an old sweep dir must not overwrite old runs)."""
    candidate, k = name, 1
    while (sweep_dir / candidate).exists():
        k += 1
        candidate = f"{name}-{k}"
    return candidate


def _importable(path: str) -> bool:
    """Whether a dotted path names an object, without Hydra's lookup, which logs its failures as errors."""
    import importlib

    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name, None)
        return obj is not None
    return False
