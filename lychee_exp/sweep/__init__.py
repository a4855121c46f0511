"""Optuna sweeps of lychee_exp jobs (or any Hydra app's): the pieces behind the `lychee_optuna` Hydra sweeper
(hydra_plugins/lychee_optuna_sweeper).

sweeper: the loop (ask -> place -> run -> tell); placement: where trials run, behind the Placement interface (here
one at a time, in launcher batches or launcher slots, or in device-slot workers; devices_per_trial=auto's choice
from measured scaling); trials: one trial's life; lychee_trials: what a lychee_exp trial gets (its TrialContext,
the OOM retry); space: the `params` grammar -> optuna distributions; storage: study, heartbeats, resume and the
trial budget; outcome: a finished job -> the trial's state; sweep_results: the files written into the sweep directory.
Above the job package: the sweeper runs jobs (any Hydra app's, through Hydra's launcher, so it never imports
lychee_exp.job); the trial's context reaches the job's ranks through lychee_exp.tracking.trial. May import: launch,
tracking, parallel, config, io, errors.
"""
