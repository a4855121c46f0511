"""The sweeper's configuration, registered as `hydra/sweeper: lychee_optuna`.

The keys are hydra-optuna-sweeper's (sampler, direction, storage, study_name, n_trials, n_jobs,
max_failure_rate, params, custom_search_space), so its users' YAML ports by changing the sweeper's name; the
rest (pruner, oom_retry, heartbeat_interval, grace_period, objectives) is this project's.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class LycheeOptunaSweeperConf:
    _target_: str = "hydra_plugins.lychee_optuna_sweeper.sweeper.LycheeOptunaSweeper"
    # Hydra must not build the sampler/pruner itself: the sweeper reports a bad _target_ as one line, and the
    # pruner's spec travels to rank 0 of each trial, which rebuilds it there.
    _recursive_: bool = False

    # Any optuna sampler; only `seed` here, because every optuna sampler accepts it (a user's _target_ merges
    # over these keys).
    sampler: Dict[str, Any] = field(
        default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": 123})
    # "maximize" | "minimize", or a list of them (multi-objective: see `objectives`)
    direction: Any = "maximize"
    # SQLAlchemy URL; null = sqlite:///<sweep dir>/optuna.db, so that re-running the command resumes the study
    storage: Optional[str] = None
    # null = the sweep directory's name
    study_name: Optional[str] = None
    # total of finished trials the study should hold (not a count per invocation)
    n_trials: int = 20
    # kept for hydra-optuna-sweeper configs; trials of one worker run one at a time, each on all `gpus`
    # (run more workers with launch/sweep_workers.sh for concurrency)
    n_jobs: int = 1
    # the sweep stops once failed trials exceed max_failure_rate * n_trials
    max_failure_rate: float = 0.25
    # key: override grammar (interval, tag(log, interval), choice, range, or a fixed value)
    params: Optional[Dict[str, Any]] = None
    # dotted path of a function (cfg: DictConfig, trial: optuna.Trial) -> None suggesting more params
    custom_search_space: Optional[str] = None

    # rank 0 reports the dev metric after every evaluation; null or optuna.pruners.NopPruner: never prune
    pruner: Optional[Dict[str, Any]] = field(
        default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner"})
    # an out-of-memory trial runs once more with half the per-device batch and twice the accumulation
    oom_retry: bool = False
    # seconds between a running trial's heartbeats; a RUNNING trial without one for grace_period seconds
    # (null = 2 x interval) belongs to a dead worker: it is failed and its params are queued again
    heartbeat_interval: int = 30
    grace_period: Optional[int] = None
    # multi-objective: metrics.json keys giving one value per direction (null = the job's return value)
    objectives: Optional[List[str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="lychee_optuna", node=LycheeOptunaSweeperConf,
                             provider="lychee_exp")
