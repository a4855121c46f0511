"""Runs `python -m lychee_exp.rerank`'s scoring on its DevicePlan: one device in this process, or N ranks started
by the launcher's elastic agent (launcher.run_ranks, as training's DDP ranks are), each scoring its share of the
batches; rank 0's result comes back."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from lychee_exp.config.commands import RerankConfig, rerank_config_from
from lychee_exp.ir.rank_reranking import rerank_on_rank
from lychee_exp.launch.failures import note_failure
from lychee_exp.launch.launcher import run_ranks
from lychee_exp.launch.processes import one_line
from lychee_exp.launch.rank_start import RankParent
from lychee_exp.launch.ranks import LOG_FORMAT, init_distributed
from lychee_exp.parallel.devices import DevicePlan, torch_device
from lychee_exp.parallel.distributed import DistEnv

log = logging.getLogger(__name__)


def launch_rerank(cfg: RerankConfig, plan: DevicePlan, output_dir: Path) -> dict:
    if plan.strategy != "ddp":
        threads = torch.get_num_threads()
        if plan.device_type == "cpu":
            torch.set_num_threads(plan.threads_per_rank)
        try:
            return rerank_on_rank(cfg, DistEnv(device=torch_device(plan.device_type)))
        finally:
            torch.set_num_threads(threads)
    log.info(plan.describe())
    payload = dataclasses.asdict(cfg)
    args = (payload, str(output_dir), plan.threads_per_rank, plan.device_type)
    return run_ranks(rerank_worker, args, plan, output_dir)[0]


def rerank_worker(payload: dict, output_dir: str, threads: int, device_type: str, parent: RankParent) -> dict:
    """Entry point of each rank the elastic agent starts (top level, so that spawn can import it)."""
    return record(_rerank_worker)(payload, output_dir, threads, device_type, parent)


def _rerank_worker(payload: dict, output_dir: str, threads: int, device_type: str, parent: RankParent) -> dict:
    parent.adopt()
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK") == "0" else logging.WARNING, format=LOG_FORMAT)
    if device_type == "cpu":
        torch.set_num_threads(threads)
    cfg = rerank_config_from(payload)
    env = init_distributed(device_type, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        result = rerank_on_rank(cfg, env)
    except BaseException as err:
        note_failure(Path(output_dir), env.rank, one_line(err))
        raise
    dist.destroy_process_group()
    return result
