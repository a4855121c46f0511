"""Hydra sweeper plugin `hydra/sweeper=lychee_optuna`: Optuna studies whose trials are lychee_exp jobs.

Hydra finds it by scanning the `hydra_plugins` namespace package; importing this package stays cheap (no
optuna import) because Hydra imports every plugin module on each start, sweeps or not.
"""
