"""What a job learns from where it runs, without loading the training stack: its run directory's stamp (which the
`lychee_stamp` resolver gives while Hydra composes) and whether it is a trial of a sweep."""

from __future__ import annotations

import os
import secrets
from datetime import datetime

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from lychee_exp.config.schema import register_schema
from lychee_exp.launch.cluster import under_torchrun


def register_config() -> None:
    """What composing a run's config needs in this process: the typed schema and the `lychee_stamp` resolver
    (python -m lychee_exp.run, and lychee_exp.job.in_process for tests, notebooks and benchmarks)."""
    register_schema()
    OmegaConf.register_new_resolver("lychee_stamp", run_stamp, use_cache=True, replace=True)


def run_stamp() -> str:
    """Run directory name. Under torchrun every rank computes it, so it must not depend on the moment:
    it comes from the rendezvous id that all ranks share (launch/torchrun.sh sets LYCHEE_RUN_STAMP)."""
    if os.environ.get("LYCHEE_RUN_STAMP"):
        return os.environ["LYCHEE_RUN_STAMP"]
    if under_torchrun():
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        return (
            f"{datetime.now():%Y-%m-%d}_torchrun-{run_id}"
            if run_id != "none"
            else f"{datetime.now():%Y-%m-%d_%H-%M}_torchrun"
        )
    # the suffix keeps two runs started in the same second apart
    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}_{secrets.token_hex(2)}"


def in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def trials_run_here() -> bool:
    """A sweep whose trials run one after another in this process (Hydra's basic launcher): the DDP ranks of
    one trial can serve the next. Under submitit each trial is a job of its own, and its ranks end with it."""
    return in_sweep() and str(HydraConfig.get().launcher.get("_target_", "")).endswith(".BasicLauncher")
