"""The sweeper's configuration, registered as `hydra/sweeper: lychee_optuna`, and the sampler group
`hydra/sweeper/sampler: tpe | random | cmaes | nsgaii | grid | gp | qmc | motpe`.

The keys and defaults are hydra-optuna-sweeper's (sampler, direction: minimize, storage, study_name, n_trials,
n_jobs, max_failure_rate, params, custom_search_space), so its users' YAML ports by changing the sweeper's name;
the rest (pruner, oom_retry, heartbeat_interval, grace_period, objectives) is this project's. Differences, with
their reasons, are listed in docs/sweeps.md.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, NoReturn, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# Each sampler's arguments as in hydra-optuna-sweeper's sampler configs; null means "Optuna's default" and is
# not passed (so `sampler._target_=` can switch to a class without some of them). Plain dicts, not typed
# nodes: a file may give any argument of the class it names, and the class itself checks them.
SAMPLERS: Dict[str, Dict[str, Any]] = {
    "tpe": {
        "_target_": "optuna.samplers.TPESampler",
        "seed": None,
        "consider_prior": None,
        "prior_weight": None,
        "consider_magic_clip": None,
        "consider_endpoints": None,
        "n_startup_trials": None,
        "n_ei_candidates": None,
        "multivariate": None,
        "warn_independent_sampling": None,
    },
    "random": {"_target_": "optuna.samplers.RandomSampler", "seed": None},
    "cmaes": {
        "_target_": "optuna.samplers.CmaEsSampler",
        "seed": None,
        "x0": None,
        "sigma0": None,
        "independent_sampler": None,
        "warn_independent_sampling": None,
        "consider_pruned_trials": None,
        "restart_strategy": None,
        "inc_popsize": None,
        "use_separable_cma": None,
        "source_trials": None,
    },
    "nsgaii": {
        "_target_": "optuna.samplers.NSGAIISampler",
        "seed": None,
        "population_size": None,
        "mutation_prob": None,
        "crossover_prob": None,
        "swapping_prob": None,
        "constraints_func": None,
    },
    # search_space: built from params when the sweep starts
    "grid": {"_target_": "optuna.samplers.GridSampler", "seed": None},
    "gp": {
        "_target_": "optuna.samplers.GPSampler",
        "seed": None,
        "independent_sampler": None,
        "n_startup_trials": None,
        "deterministic_objective": None,
        "constraints_func": None,
        "warn_independent_sampling": None,
    },
    "qmc": {
        "_target_": "optuna.samplers.QMCSampler",
        "seed": None,
        "qmc_type": None,
        "scramble": None,
        "independent_sampler": None,
        "warn_asynchronous_seeding": None,
        "warn_independent_sampling": None,
    },
    # removed from Optuna 4: the sweeper stops with one line pointing to tpe
    "motpe": {"_target_": f"{__name__}.raise_motpe_removed"},
}

MOTPE_REMOVED = (
    "The 'motpe' sampler was removed in Optuna 4.0 (optuna.samplers.MOTPESampler): use "
    "hydra/sweeper/sampler=tpe, whose TPESampler handles several objectives"
)


def raise_motpe_removed(*args: Any, **kwargs: Any) -> NoReturn:
    """The `_target_` of the motpe sampler config: building it says what to use instead."""
    raise ValueError(MOTPE_REMOVED)


@dataclass
class MOTPESamplerConfig:
    """hydra-optuna-sweeper's name for the motpe sampler node (instantiating it raises)."""

    _target_: str = SAMPLERS["motpe"]["_target_"]


@dataclass
class LycheeOptunaSweeperConf:
    _target_: str = "hydra_plugins.lychee_optuna_sweeper.sweeper.LycheeOptunaSweeper"
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    # Hydra must not build the sampler/pruner itself: the sweeper reports a bad _target_ as one line, and the
    # pruner's spec travels to rank 0 of each lychee_exp trial, which rebuilds it there.
    _recursive_: bool = False

    # from the sampler group (hydra/sweeper/sampler=...), or a `_target_` to any optuna sampler and its arguments
    sampler: Any = MISSING
    # "minimize" | "maximize", or a list of them: the task function then returns one value per direction
    direction: Any = "minimize"
    # SQLAlchemy URL; null = sqlite:///<sweep dir>/optuna.db, so that re-running the command resumes the study
    storage: Optional[str] = None
    # null = the sweep directory's name
    study_name: Optional[str] = None
    # total of finished trials the study should hold (not a count per invocation)
    n_trials: int = 20
    # trials in flight at once in this worker, where the launcher runs jobs at once (submitit: each slot is
    # refilled as its trial ends; joblib, ray: batches); the basic launcher runs them one at a time
    n_jobs: int = 1
    # the sweep stops once failed trials exceed max_failure_rate * n_trials (a value in [0, 1])
    max_failure_rate: float = 0.25
    # key: override grammar (choice, range, interval, tag(log, ...), int(...), or a fixed value)
    params: Optional[Dict[str, Any]] = None
    # dotted path of a function (cfg: DictConfig, trial: optuna.Trial) -> None suggesting more params
    custom_search_space: Optional[str] = None
    # hydra-optuna-sweeper < 1.2's search space format, removed upstream: the sweeper says how to write params
    search_space: Any = None

    # lychee_exp jobs: rank 0 reports the dev metric after every evaluation; null or NopPruner: never prune
    pruner: Optional[Dict[str, Any]] = field(default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner"})
    # lychee_exp jobs: an out-of-memory trial runs once more with half the per-device batch, twice the accumulation
    oom_retry: bool = False
    # seconds between a running trial's heartbeats; a RUNNING trial without one for grace_period seconds
    # (null = 2 x interval) belongs to a dead worker: it is failed and its params are queued again
    heartbeat_interval: int = 30
    grace_period: Optional[int] = None
    # multi-objective lychee_exp jobs: metrics.json keys giving one value per direction (null = the return value)
    objectives: Optional[List[str]] = None
    # all: every trial across every device, one at a time; N: floor(devices / N) trials at once, each on its own
    # N devices (its own CUDA_VISIBLE_DEVICES share, or CPU cores); auto: N from measured scaling (docs/sweeps.md).
    # Any: a word or a number (OmegaConf has no union type); the sweeper refuses anything else in one line
    devices_per_trial: Any = "all"


_store = ConfigStore.instance()
_store.store(group="hydra/sweeper", name="lychee_optuna", node=LycheeOptunaSweeperConf, provider="lychee_exp")
for _name, _node in SAMPLERS.items():
    _store.store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="lychee_exp")
