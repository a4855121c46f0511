"""Runs one training job on its DevicePlan and hands rank 0's metrics back to the Hydra process.

- single / dp: in the Hydra process itself, reusing the inputs that preflight read (`train_in_process`,
  which the speedup calibration uses too).
- ddp in a sweep whose trials run in the sweep worker's process: warm ranks (lychee_exp.warm_ranks), kept
  alive from one trial to the next; each trial builds its own model, optimizer, data order, seeds and logger.
- ddp otherwise: fresh worker processes per run, started with torch's elastic launcher (the API behind torchrun):
  c10d rendezvous on 127.0.0.1 with a free port (two runs can share a machine), per-rank logs in
  <run>/logs, and no restarts unless asked. Workers get the resolved config as a plain dict: Hydra's state
  does not exist in child processes. A failing, OOM-ing or killed rank makes the agent stop the others at once.
- under torchrun (the user launched the ranks): this process is already one rank; train in place.
- in a SLURM job on several nodes (lychee_exp.cluster): this node's ranks, as above, with the agents of all
  nodes meeting at the first node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lychee_exp.cluster import NodeSpec, slurm_nodes, under_torchrun
from lychee_exp.config import RunConfig, plain_dict, to_run_config
from lychee_exp.devices import DevicePlan, torch_device
from lychee_exp.distributed import DistEnv
from lychee_exp.errors import RunFailed, TrainingDiverged
from lychee_exp.inputs import RunInputs
from lychee_exp.preemption import PreemptionWatch, install_rank_handler
from lychee_exp.rank_failures import (
    FAILURE_NOTES,
    collateral,
    failure_kind,
    first_cause,
    lost_nodes,
    note_failure,
    with_notes,
)
from lychee_exp.throughput import reset_peak_memory
from lychee_exp.train import run_training
from lychee_exp.warm_ranks import RankSetup, RanksFailed, die_with_parent, one_line, warm_ranks

log = logging.getLogger(__name__)


def launch(
    cfg: RunConfig,
    plan: DevicePlan,
    output_dir: Path,
    log_file: str | None = None,
    inputs: RunInputs | None = None,
    keep_ranks: bool = False,
) -> dict:
    """keep_ranks: DDP ranks may outlive this run, for the next one in this process (a sweep's trials)."""
    with PreemptionWatch(output_dir) as watch:
        metrics = _launch(cfg, plan, output_dir, log_file, inputs, keep_ranks)
    if "preempted_at_step" in metrics:
        watch.hand_over(metrics["preempted_at_step"])  # submitit requeues the job (and exits), else Preempted
    return metrics


def _launch(
    cfg: RunConfig, plan: DevicePlan, output_dir: Path, log_file: str | None, inputs: RunInputs | None, keep_ranks: bool
) -> dict:
    if plan.strategy != "ddp":
        return train_in_process(cfg, plan, output_dir, inputs)
    if under_torchrun():
        return _as_rank(cfg, plan, output_dir, inputs)
    nodes = slurm_nodes()
    # warm ranks cannot restart (max_restarts) or span nodes: those runs get the elastic agent
    if keep_ranks and cfg.parallel.warm_ranks and cfg.parallel.max_restarts == 0 and nodes is None:
        return _warm_launch(cfg, plan, output_dir, log_file)
    return _elastic_launch(cfg, plan, output_dir, log_file, nodes)


def train_in_process(cfg: RunConfig, plan: DevicePlan, output_dir: Path, inputs: RunInputs | None = None) -> dict:
    """Trains on the plan's one process (single or dp) here; a diverged or OOM run becomes RunFailed."""
    threads = torch.get_num_threads()
    if plan.device_type == "cpu":
        torch.set_num_threads(plan.threads_per_rank)
    try:
        return run_training(cfg, DistEnv(device=torch_device(plan.device_type)), plan, output_dir, inputs)
    except TrainingDiverged as err:
        raise RunFailed(f"TrainingDiverged: {err}", "diverged") from err
    except torch.OutOfMemoryError as err:
        raise RunFailed(f"out of memory: {str(err).splitlines()[0]}", "oom") from err
    finally:
        torch.set_num_threads(threads)
        if plan.device_type == "cuda":
            torch.cuda.empty_cache()


def _elastic_launch(
    cfg: RunConfig, plan: DevicePlan, output_dir: Path, log_file: str | None, nodes: NodeSpec | None = None
) -> dict:
    log_dir = output_dir / "logs"
    log.info(plan.describe())
    nnodes = nodes.nnodes if nodes else 1
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=plan.num_devices,
        run_id=nodes.run_id if nodes else f"lychee-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=nodes.endpoint if nodes else "127.0.0.1:0",
        max_restarts=cfg.parallel.max_restarts,
        rdzv_configs={"is_host": nodes.node_rank == 0} if nodes else {},
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.ALL}),
        log_line_prefix_template="[rank${rank}] ",
    )
    if cfg.parallel.max_restarts > 0 and cfg.trainer.resume == "never":
        # a restarted attempt continues from the latest checkpoint (trainer.checkpoint_every) of this run
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="auto"))
    payload = plain_dict(cfg)
    shutil.rmtree(output_dir / FAILURE_NOTES, ignore_errors=True)  # notes of an earlier attempt in this dir
    # The agent logs each failure with a full dump; the one line below (with the rank's log) replaces it.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, worker)(
            payload, str(output_dir), plan.threads_per_rank, plan.device_type, log_file
        )
    except SignalException as err:
        # Ctrl-C / SIGTERM reached the launcher, which has stopped the ranks: stop the job (and any sweep) too.
        if err.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise SystemExit(128 + int(err.sigval)) from None
    except ChildFailedError as err:
        rank, message = first_cause(with_notes(_agent_view(err.failures), output_dir / FAILURE_NOTES))
        logs = sorted(log_dir.glob(f"**/attempt_*/{rank}/stderr.log"))
        where = f" (log: {logs[-1]})" if logs else ""
        if nodes and collateral(message):
            raise RunFailed(lost_nodes(nodes, output_dir / FAILURE_NOTES, rank, message) + where, "crashed") from None
        raise RunFailed(f"rank {rank} failed: {message}{where}", failure_kind(message)) from None
    return results[min(results)]  # rank 0's metrics (every rank returns the same; other nodes lack rank 0)


def _agent_view(failures: dict) -> dict[int, tuple[float, str]]:
    """What the elastic agent saw of each failed rank: when it ended, and its last error line or exit code."""
    described = {}
    for rank, failure in failures.items():
        message = failure.message  # a dict when the worker's @record wrote an error file
        message = str(message.get("message", message) if isinstance(message, dict) else message).strip()
        message = message.splitlines()[-1] if message else f"exit code {failure.exitcode}"
        described[rank] = (float(failure.timestamp), message)
    return described


# ----------------------------------------------------------------------------------------------- warm ranks
WARM_LOGS = "logs/warm"


def _warm_launch(cfg: RunConfig, plan: DevicePlan, output_dir: Path, log_file: str | None) -> dict:
    setup = RankSetup(
        plan.num_devices, plan.device_type, plan.threads_per_rank, cfg.parallel.backend, cfg.parallel.timeout_s
    )
    environ = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV)}
    try:
        ranks, reused = warm_ranks(setup, _warm_init, _warm_job)
        kept = "warm ranks of an earlier trial" if reused else "warm ranks, kept for the next trial"
        log.info("%s (%s)", plan.describe(), kept)
        results = ranks.run(plain_dict(cfg), str(output_dir), log_file, environ)
    except RanksFailed as err:
        rank, message = first_cause(err.failures)
        rank_log = output_dir / WARM_LOGS / str(rank) / "stderr.log"
        where = f" (log: {rank_log})" if rank_log.exists() else ""
        raise RunFailed(f"rank {rank} failed: {message}{where}", failure_kind(message)) from None
    return {**results[0], "warm_ranks": reused}


# what a trial's environment may change for its ranks: fault injection in tests, the study's storage, W&B's
_PASSED_ENV = ("LYCHEE_", "WANDB_")


def _warm_init(setup: RankSetup) -> DistEnv:
    """Once per warm rank: threads and the process group."""
    if setup.device_type == "cpu":
        torch.set_num_threads(setup.threads)
    return init_distributed(setup.device_type, setup.backend, setup.timeout_s)


_console: TextIO | None = None  # a warm rank's own stderr (the sweep's console), kept before the first redirect


def _redirect_output(rank_log: Path) -> TextIO:
    """Everything this rank prints goes to the trial's rank log (as the elastic agent's redirects do); returns
    the console, where rank 0 keeps logging the trial's story (as the agent's tee does)."""
    global _console
    if _console is None:
        _console = os.fdopen(os.dup(2), "w", buffering=1)
    rank_log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(rank_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return _console


def _warm_job(env: DistEnv, payload: dict, output_dir: str, log_file: str | None, environ: dict) -> dict:
    """One trial on a warm rank. Everything the trial owns is built here (run_training seeds, builds the model,
    optimizer, data order and logger); the logs go to <run>/logs/warm/<rank>/stderr.log."""
    for key in [k for k in os.environ if k.startswith(_PASSED_ENV) and k not in environ]:
        del os.environ[key]
    os.environ.update(environ)
    run_dir = Path(output_dir)
    rank_log = run_dir / WARM_LOGS / str(env.rank) / "stderr.log"
    console = _redirect_output(rank_log)
    _configure_worker_logging(env.rank, log_file, console if env.is_main else None)
    install_rank_handler(run_dir)
    reset_peak_memory(env.device)
    cfg = to_run_config(payload)
    plan = DevicePlan("ddp", env.device.type, env.world_size, torch.get_num_threads())
    try:
        return run_training(cfg, env, plan, run_dir)
    except BaseException:
        traceback.print_exc()  # into the rank log; the sweep gets one line
        raise
    finally:
        if env.device.type == "cuda":
            torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------- ranks of one run
def _as_rank(cfg: RunConfig, plan: DevicePlan, output_dir: Path, inputs: RunInputs | None) -> dict:
    die_with_parent()  # torchrun's agent killed: its ranks must not train on as orphans
    install_rank_handler(output_dir)
    if plan.device_type == "cpu":
        torch.set_num_threads(plan.threads_per_rank)
    env = init_distributed(plan.device_type, cfg.parallel.backend, cfg.parallel.timeout_s)
    plan = dataclasses.replace(plan, num_devices=env.world_size)  # all nodes' ranks, not this node's GPUs
    try:
        if not env.is_main:
            _quiet_non_main_logging()
        return run_training(cfg, env, plan, output_dir, inputs)
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
        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
    )


def worker(payload: dict, output_dir: str, threads: int, device_type: str, log_file: str | None) -> dict:
    """Entry point of each spawned rank (top level, so that spawn can import it)."""
    return record(_worker)(payload, output_dir, threads, device_type, log_file)


def _worker(payload: dict, output_dir: str, threads: int, device_type: str, log_file: str | None) -> dict:
    die_with_parent()
    install_rank_handler(Path(output_dir))
    rank = int(os.environ["RANK"])
    _configure_worker_logging(rank, log_file)
    if device_type == "cpu":
        torch.set_num_threads(threads)
    cfg = to_run_config(payload)
    plan = DevicePlan("ddp", device_type, int(os.environ["WORLD_SIZE"]), threads)
    env = init_distributed(device_type, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        result = run_training(cfg, env, plan, Path(output_dir))
    except BaseException as err:
        note_failure(Path(output_dir), rank, one_line(err))
        raise  # no destroy_process_group: with a peer gone it can block, and this process ends anyway
    dist.destroy_process_group()
    return result
