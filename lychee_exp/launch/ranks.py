"""What each rank process runs: a rank of one run (spawned by the elastic agent, or started by torchrun) and a
warm rank's trial (lychee_exp.launch.warm_ranks keeps the process between a sweep's trials). The launcher, in the job's
process, decides which and starts them; this module is the other side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Iterator, TextIO

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from lychee_exp.config.schema import RunConfig, to_run_config
from lychee_exp.launch.failures import FAILURE_NOTES, note_failure
from lychee_exp.launch.preemption import install_rank_handler
from lychee_exp.launch.processes import die_with_parent, one_line
from lychee_exp.launch.rank_memory import note_pid
from lychee_exp.launch.rank_start import RankParent
from lychee_exp.launch.step_hooks import rank_hooks
from lychee_exp.launch.warm_ranks import RankSetup
from lychee_exp.parallel.devices import DevicePlan, rank_strategy, torch_device
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.tracking.throughput import reset_peak_memory
from lychee_exp.tracking.trial import trial_number
from lychee_exp.train.inputs import RunInputs
from lychee_exp.train.trainer import train_on_rank

WARM_LOGS = "logs/warm"


# what a trial's environment may change for its ranks: fault injection in tests, the study's storage, W&B's
PASSED_ENV = ("LYCHEE_", "WANDB_")
# Hydra's job_logging format: a rank's lines read as its job's, with their time (progress lines: io.progress)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def warm_init(setup: RankSetup) -> DistEnv:
    """Once per warm rank: threads and the process group."""
    if setup.device_type == "cpu":
        torch.set_num_threads(setup.threads)
    return init_distributed(setup.device_type, setup.backend, setup.timeout_s)


@contextlib.contextmanager
def _output_to(rank_log: Path) -> Iterator[TextIO]:
    """While a trial runs, everything this rank prints goes to the trial's rank log (as the elastic agent's
    redirects do); yields the console, where rank 0 logs the trial's story (as the agent's tee does)."""
    rank_log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(rank_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    console = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    try:
        yield console
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)  # between trials, output is no trial's
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        console.close()


def warm_job(env: DistEnv, payload: dict, output_dir: str, log_file: str | None, environ: dict) -> dict:
    """One trial on a warm rank. Everything the trial owns is built here (train_on_rank seeds, builds the model,
    optimizer, data order and logger); its output goes to <run>/logs/warm/<rank>/stderr.log."""
    for key in [k for k in os.environ if k.startswith(PASSED_ENV) and k not in environ]:
        del os.environ[key]
    os.environ.update(environ)
    run_dir = Path(output_dir)
    gc.collect()  # the last trial's model and optimizer, should anything of theirs sit in a reference cycle
    gc.freeze()  # what survived is long-lived (modules, caches): later collections skip it (0.25 s each, else)
    if env.device.type == "cuda":
        torch.cuda.empty_cache()  # the last trial's blocks, for this trial's peak and for other processes
    reset_peak_memory(env.device)
    with _output_to(run_dir / WARM_LOGS / str(env.rank) / "stderr.log") as console:
        try:
            _configure_worker_logging(env.rank, log_file, console if env.is_main else None)
            install_rank_handler(run_dir)
            cfg = to_run_config(payload)
            strategy = rank_strategy(cfg.parallel.strategy)
            plan = DevicePlan(strategy, env.device.type, env.world_size, torch.get_num_threads())
            result = train_on_rank(
                cfg, env, plan, run_dir, hooks=rank_hooks(run_dir, env, trial_number(), cfg.data.batch_size)
            )
        except BaseException:
            traceback.print_exc()  # into the rank log; the sweep gets one line
            raise  # no cleanup here: with a peer gone, freeing CUDA memory could wait on a collective forever
        finally:
            logging.basicConfig(handlers=[logging.StreamHandler(sys.stderr)], force=True)  # close the trial's files
    return result


def as_rank(cfg: RunConfig, plan: DevicePlan, output_dir: Path, inputs: RunInputs | None) -> dict:
    die_with_parent()  # torchrun's agent killed: its ranks must not train on as orphans
    install_rank_handler(output_dir)
    if plan.device_type == "cpu":
        torch.set_num_threads(plan.threads_per_rank)
    env = init_distributed(plan.device_type, cfg.parallel.backend, cfg.parallel.timeout_s)
    plan = dataclasses.replace(plan, num_devices=env.world_size)  # all nodes' ranks, not this node's GPUs
    try:
        if not env.is_main:
            _quiet_non_main_logging()
        return train_on_rank(
            cfg, env, plan, output_dir, inputs, rank_hooks(output_dir, env, trial_number(), cfg.data.batch_size)
        )
    finally:
        dist.destroy_process_group()


def init_distributed(device_type: str, backend: str, timeout_s: int) -> DistEnv:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch_device(device_type, local_rank)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _quiet_non_main_logging() -> None:
    logging.getLogger().setLevel(logging.WARNING)


def _configure_worker_logging(rank: int, log_file: str | None, console: TextIO | None = None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if rank == 0 and log_file:
        handlers.append(logging.FileHandler(log_file))  # rank 0 continues the Hydra job's log
    if console:
        handlers.append(logging.StreamHandler(console))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        handlers=handlers,
        force=True,  # a warm rank's next trial replaces the last one's files
        format=LOG_FORMAT,
    )


def worker(
    payload: dict, output_dir: str, threads: int, device_type: str, log_file: str | None, parent: RankParent
) -> dict:
    """Entry point of each rank the elastic agent starts (top level, so that spawn can import it)."""
    return record(_worker)(payload, output_dir, threads, device_type, log_file, parent)


def _worker(
    payload: dict, output_dir: str, threads: int, device_type: str, log_file: str | None, parent: RankParent
) -> dict:
    parent.adopt()
    install_rank_handler(Path(output_dir))
    rank = int(os.environ["RANK"])
    note_pid(Path(output_dir) / FAILURE_NOTES, rank)  # the launcher watches its memory (a SIGKILL leaves no note)
    _configure_worker_logging(rank, log_file)
    if device_type == "cpu":
        torch.set_num_threads(threads)
    cfg = to_run_config(payload)
    plan = DevicePlan(rank_strategy(cfg.parallel.strategy), device_type, int(os.environ["WORLD_SIZE"]), threads)
    env = init_distributed(device_type, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        hooks = rank_hooks(Path(output_dir), env, trial_number(), cfg.data.batch_size)
        result = train_on_rank(cfg, env, plan, Path(output_dir), hooks=hooks)
    except BaseException as err:
        note_failure(Path(output_dir), rank, one_line(err))
        raise  # no destroy_process_group: with a peer gone it can block, and this process ends anyway
    dist.destroy_process_group()
    return result
