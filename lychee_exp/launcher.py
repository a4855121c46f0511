"""Runs one training job on its DevicePlan and hands rank 0's metrics back to the Hydra process.

- single / dp: in the Hydra process itself, reusing the inputs that preflight read (`train_in_process`,
  which the speedup calibration uses too).
- ddp: fresh worker processes per run, started with torch's elastic launcher (the API behind torchrun):
  c10d rendezvous on 127.0.0.1 with a free port (two runs can share a machine), per-rank logs in
  <run>/logs, and no restarts unless asked. Workers get the resolved config as a plain dict: Hydra's state
  does not exist in child processes. A failing, OOM-ing or killed rank makes the agent stop the others at once.
- under torchrun (the user launched the ranks): this process is already one rank; train in place.
- in a SLURM job on several nodes (lychee_exp.cluster): this node's ranks, as above, with the agents of all
  nodes meeting at the first node.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

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
from lychee_exp.train import run_training

log = logging.getLogger(__name__)


def failure_kind(message: str) -> str:
    if "TrainingDiverged" in message or "loss is nan" in message or "loss is inf" in message:
        return "diverged"
    if "out of memory" in message.lower() or "OutOfMemoryError" in message:
        return "oom"
    return "crashed"


def launch(
    cfg: RunConfig, plan: DevicePlan, output_dir: Path, log_file: str | None = None, inputs: RunInputs | None = None
) -> dict:
    with PreemptionWatch(output_dir) as watch:
        metrics = _launch(cfg, plan, output_dir, log_file, inputs)
    if "preempted_at_step" in metrics:
        watch.hand_over(metrics["preempted_at_step"])  # submitit requeues the job (and exits), else Preempted
    return metrics


def _launch(cfg: RunConfig, plan: DevicePlan, output_dir: Path, log_file: str | None, inputs: RunInputs | None) -> dict:
    if plan.strategy != "ddp":
        return train_in_process(cfg, plan, output_dir, inputs)
    if under_torchrun():
        return _as_rank(cfg, plan, output_dir, inputs)
    return _elastic_launch(cfg, plan, output_dir, log_file, slurm_nodes())


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
        rank, message = _root_cause(err.failures, output_dir / FAILURE_NOTES)
        logs = sorted(log_dir.glob(f"**/attempt_*/{rank}/stderr.log"))
        where = f" (log: {logs[-1]})" if logs else ""
        if nodes and _collateral(message):
            raise RunFailed(_lost_nodes(nodes, output_dir / FAILURE_NOTES, rank, message) + where, "crashed") from None
        raise RunFailed(f"rank {rank} failed: {message}{where}", failure_kind(message)) from None
    return results[min(results)]  # rank 0's metrics (every rank returns the same; other nodes lack rank 0)


# Errors that ranks report because ANOTHER rank died (its sockets closed, or the agent stopped them).
_COLLATERAL = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "SIGTERM",
    "NCCL",
    "gloo",
    "Gloo",
    "ProcessGroup",
)


def _root_cause(failures: dict, notes: Path) -> tuple[int, str]:
    """The failure to report: the earliest one that is not a consequence of another rank's failure. The ranks'
    own notes (written as they fail) come first; the agent's view (which exits it saw) fills the gaps, e.g. a
    rank killed by a signal writes no note."""
    described = {}
    for rank, failure in failures.items():
        message = failure.message  # a dict when the worker's @record wrote an error file
        message = str(message.get("message", message) if isinstance(message, dict) else message).strip()
        message = message.splitlines()[-1] if message else f"exit code {failure.exitcode}"
        described[rank] = (float(failure.timestamp), message)
    for note in notes.glob("rank*.txt"):
        stamp, _, message = note.read_text().strip().partition("\t")
        described[int(note.stem[len("rank") :])] = (float(stamp), message)
    ranked = sorted((_collateral(message), stamp, rank, message) for rank, (stamp, message) in described.items())
    _, _, rank, message = ranked[0]
    return rank, message


def _collateral(message: str) -> bool:
    return any(m in message for m in _COLLATERAL)


def _lost_nodes(nodes: NodeSpec, notes: Path, rank: int, message: str) -> str:
    """The one line for a rank that lost its peers: the nodes whose ranks left no failure note are the ones
    that went away (killed, preempted, or cut off)."""
    noted = {int(p.stem[len("node") :]) for p in notes.glob("node*")}
    lost = [nodes.node_name(k) for k in range(nodes.nnodes) if k != nodes.node_rank and k not in noted]
    return (
        f"lost {', '.join(lost) or 'another node'}: rank {rank} on {nodes.node_name(nodes.node_rank)} failed: {message}"
    )


def _as_rank(cfg: RunConfig, plan: DevicePlan, output_dir: Path, inputs: RunInputs | None) -> dict:
    _die_with_parent()  # torchrun's agent killed: its ranks must not train on as orphans
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


def _configure_worker_logging(rank: int, log_file: str | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if rank == 0 and log_file:
        handlers.append(logging.FileHandler(log_file))  # rank 0 continues the Hydra job's log
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        handlers=handlers,
        force=True,
        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
    )


def worker(payload: dict, output_dir: str, threads: int, device_type: str, log_file: str | None) -> dict:
    """Entry point of each spawned rank (top level, so that spawn can import it)."""
    return record(_worker)(payload, output_dir, threads, device_type, log_file)


def _die_with_parent() -> None:
    """If the launching process is killed (SIGKILL, OOM killer), its ranks must not train on as orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def _worker(payload: dict, output_dir: str, threads: int, device_type: str, log_file: str | None) -> dict:
    _die_with_parent()
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
        _note_failure(Path(output_dir), rank, err)
        raise  # no destroy_process_group: with a peer gone it can block, and this process ends anyway
    dist.destroy_process_group()
    return result


FAILURE_NOTES = "logs/failures"


def _note_failure(output_dir: Path, rank: int, err: BaseException) -> None:
    """Each failing rank writes when and why at once, before any teardown: the launcher then names the rank
    that failed first, not one that the agent happened to see exit first."""
    notes = output_dir / FAILURE_NOTES
    notes.mkdir(parents=True, exist_ok=True)
    message = (f"{type(err).__name__}: {err}".strip().splitlines() or [type(err).__name__])[-1]
    (notes / f"rank{rank}.txt").write_text(f"{time.time():.6f}\t{message}\n")
    (notes / f"node{os.environ.get('SLURM_NODEID', '0')}").touch()  # this node was alive to write a note
