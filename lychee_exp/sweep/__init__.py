"""Optuna sweeps of lychee_exp jobs: the pieces behind the `lychee_optuna` Hydra sweeper
(hydra_plugins/lychee_optuna_sweeper) and the pruning hook that rank 0 of each trial runs.

space: the `params` grammar -> optuna distributions; storage: study, heartbeats, resume and the trial budget;
outcome: a finished job -> the trial's state; results: the files written into the sweep directory;
pruning: rank 0's report-and-prune callback.
May import: lychee_exp.core, lychee_exp.tracking (never the recipe, the launcher or a job: trials are Hydra jobs).
"""
