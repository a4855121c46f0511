"""Runs one training job on its DevicePlan and hands rank 0's metrics back to the Hydra process.

- single / dp: in the Hydra process itself, reusing the inputs that preflight read (`train_in_process`,
  which the speedup calibration uses too).
- ddp in a sweep whose trials run in the sweep worker's process: warm ranks (lychee_exp.launch.warm_ranks), kept
  alive from one trial to the next; each trial builds its own model, optimizer, data order, seeds and logger.
- ddp otherwise: fresh worker processes per run, started with torch's elastic launcher (the API behind torchrun):
  c10d rendezvous on 127.0.0.1 with a free port (two runs can share a machine), per-rank logs in
  <run>/logs, and no restarts unless asked. Workers get the resolved config as a plain dict: Hydra's state
  does not exist in child processes. A failing, OOM-ing or killed rank makes the agent stop the others at once.
- under torchrun (the user launched the ranks): this process is already one rank; train in place.
- in a SLURM job on several nodes (lychee_exp.launch.cluster): this node's ranks, as above, with the agents of all
  nodes meeting at the first node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lychee_exp.config.schema import RunConfig, plain_dict
from lychee_exp.errors import STOP_SIGNALS, RunFailed, Terminated, TrainingDiverged
from lychee_exp.launch.cluster import NodeSpec, slurm_nodes, under_torchrun
from lychee_exp.launch.failures import (
    FAILURE_NOTES,
    collateral,
    failure_kind,
    first_cause,
    killed_by_signal,
    lost_nodes,
    rank_failure,
    with_notes,
)
from lychee_exp.launch.preemption import PreemptionWatch
from lychee_exp.launch.rank_memory import PeakWatch, noted_pids
from lychee_exp.launch.rank_start import rank_start, stop_server
from lychee_exp.launch.ranks import PASSED_ENV, WARM_LOGS, as_rank, warm_init, warm_job, worker
from lychee_exp.launch.step_hooks import rank_hooks
from lychee_exp.launch.warm_ranks import RankSetup, RanksFailed, close_warm_ranks, warm_ranks
from lychee_exp.parallel.devices import RANK_STRATEGIES, DevicePlan, torch_device
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.tracking.trial import trial_number
from lychee_exp.train.inputs import RunInputs
from lychee_exp.train.trainer import train_on_rank

log = logging.getLogger(__name__)
QUIET_CTRL_C_ENV = "LYCHEE_RANK_QUIET_CTRL_C"  # ranks started with it end silently on Ctrl-C (lychee_exp/__init__)


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
    if plan.strategy not in RANK_STRATEGIES:
        return train_in_process(cfg, plan, output_dir, inputs)
    if under_torchrun():
        return as_rank(cfg, plan, output_dir, inputs)
    nodes = slurm_nodes()
    # warm ranks cannot restart (max_restarts) or span nodes: those runs get the elastic agent
    if keep_ranks and cfg.parallel.warm_ranks and cfg.parallel.max_restarts == 0 and nodes is None:
        return _warm_launch(cfg, plan, output_dir, log_file)
    close_warm_ranks()  # idle ranks of earlier trials would hold memory (a GPU's) while this run's ranks train
    return _elastic_launch(cfg, plan, output_dir, log_file, nodes)


def train_in_process(cfg: RunConfig, plan: DevicePlan, output_dir: Path, inputs: RunInputs | None = None) -> dict:
    """Trains on the plan's one process (single or dp) here; a diverged or OOM run becomes RunFailed."""
    threads = torch.get_num_threads()
    if plan.device_type == "cpu":
        torch.set_num_threads(plan.threads_per_rank)
    else:
        close_warm_ranks()  # idle ranks of earlier trials would hold GPU memory while this one trains
    try:
        env = DistEnv(device=torch_device(plan.device_type))
        return train_on_rank(
            cfg, env, plan, output_dir, inputs, rank_hooks(output_dir, env, trial_number(), cfg.data.batch_size)
        )
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
    log.info(plan.describe())
    if cfg.parallel.max_restarts > 0 and cfg.trainer.resume == "never":
        # a restarted attempt continues from the latest checkpoint (trainer.checkpoint_every) of this run
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="auto"))
    payload = plain_dict(cfg)
    args = (payload, str(output_dir), plan.threads_per_rank, plan.device_type, log_file)
    results = run_ranks(worker, args, plan, output_dir, cfg.parallel.max_restarts, nodes)
    return results[min(results)]  # rank 0's metrics (every rank returns the same; other nodes lack rank 0)


def run_ranks(
    entrypoint: Callable, args: tuple, plan: DevicePlan, output_dir: Path, max_restarts: int = 0, nodes=None
) -> dict[int, Any]:
    """Starts plan.num_devices ranks of entrypoint(*args, parent) with torch's elastic agent (c10d rendezvous on a
    free local port, per-rank logs in <output_dir>/logs, rank 0's teed; parent: launch.rank_start.RankParent) and
    returns each local rank's result. A failed rank stops the others and becomes one RunFailed line naming it
    and its log."""
    log_dir, notes = output_dir / "logs", output_dir / FAILURE_NOTES
    nnodes = nodes.nnodes if nodes else 1
    watch = PeakWatch(lambda: noted_pids(notes))  # the ranks' peak memory, for a rank killed by a signal
    os.environ[QUIET_CTRL_C_ENV] = "1"  # the ranks end silently on Ctrl-C: this process says the one line
    # torch's agent leaves its signal handlers (raising SignalException) installed after the launch: a SIGTERM after
    # it (SLURM's requeue, while submitit hands the preemption over) must reach the handler we had
    handlers = _stop_handlers()
    # the agent handles the signals this process would stop on, and no other: nohup's ignored SIGHUP stays ignored
    handled = [s for s in handlers if handlers[s] is not signal.SIG_IGN] or [signal.SIGINT, signal.SIGTERM]
    try:
        start_method, parent = rank_start(plan.device_type)
        config = LaunchConfig(
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=plan.num_devices,
            run_id=nodes.run_id if nodes else f"lychee-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint=nodes.endpoint if nodes else "127.0.0.1:0",
            max_restarts=max_restarts,
            rdzv_configs={"is_host": nodes.node_rank == 0} if nodes else {},
            monitor_interval=0.2,
            start_method=start_method,
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.ALL}),
            log_line_prefix_template="[rank${rank}] ",
            signals_to_handle=",".join(signal.Signals(s).name for s in handled),
        )
        shutil.rmtree(notes, ignore_errors=True)  # notes of an earlier attempt in this dir
        # The agent logs each failure with a full dump; the one line below (with the rank's log) replaces it.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        # its own level (WARNING): "Received 2 death signal, shutting down workers" would add a line to Ctrl-C's one
        logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
        with watch:
            return elastic_launch(config, entrypoint)(*args, parent)
    except SignalException as err:
        _stop_on_signal(err)
    except ChildFailedError as err:
        rank, message = first_cause(with_notes(_agent_view(err.failures, watch), notes))
        logs = sorted(log_dir.glob(f"**/attempt_*/{rank}/stderr.log"))
        where = f" (log: {logs[-1]})" if logs else ""
        if nodes and collateral(message):
            raise RunFailed(lost_nodes(nodes, notes, rank, message) + where, "crashed") from None
        raise RunFailed(rank_failure(rank, message) + where, failure_kind(message)) from None
    finally:
        os.environ.pop(QUIET_CTRL_C_ENV, None)
        _restore(handlers)


def _stop_handlers() -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *STOP_SIGNALS)}


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def _stop_on_signal(err: SignalException) -> None:
    """Ctrl-C or a stop signal reached the launcher (torch's agent turns them into SignalException, and its handlers
    stay installed in this process), and the ranks are stopped: stop the job, and any sweep, too."""
    stop_server()
    if err.sigval == signal.SIGINT:
        raise KeyboardInterrupt from None
    raise Terminated(err.sigval) from None


def _agent_view(failures: dict, watch: PeakWatch) -> dict[int, tuple[float, str]]:
    """What the elastic agent saw of each failed rank: when it ended, and its last error line, the signal that
    killed it (with the peak memory the watch saw) or its exit code."""
    described = {}
    for rank, failure in failures.items():
        message = failure.message  # a dict when the worker's @record wrote an error file
        message = str(message.get("message", message) if isinstance(message, dict) else message).strip()
        if failure.exitcode < 0 and not isinstance(failure.message, dict):  # the agent's "Signal 9 (SIGKILL) ..."
            message = killed_by_signal(-failure.exitcode, failure.pid, watch.peak_mb(failure.pid))
        message = message.splitlines()[-1] if message else f"exit code {failure.exitcode}"
        described[rank] = (float(failure.timestamp), message)
    return described


# ----------------------------------------------------------------------------------------------- warm ranks
# set in this process by an import, not by the user: sklearn/joblib set them when optuna's fANOVA importances (the
# sweep's results after a trial) load sklearn; they must not make the next trial start new ranks
IMPORT_SET_ENV = frozenset({"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"})


def startup_environ(environ: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of the environment that warm ranks keep from their start (RankSetup.environ): all but what a job
    hands over itself (PASSED_ENV) and what imports set."""
    return tuple(sorted((k, v) for k, v in environ.items() if not k.startswith(PASSED_ENV) and k not in IMPORT_SET_ENV))


def _warm_launch(cfg: RunConfig, plan: DevicePlan, output_dir: Path, log_file: str | None) -> dict:
    environ = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV)}
    startup = startup_environ(dict(os.environ))
    setup = RankSetup(
        plan.num_devices, plan.device_type, plan.threads_per_rank, cfg.parallel.backend, cfg.parallel.timeout_s, startup
    )
    try:
        ranks, reused = warm_ranks(setup, warm_init, warm_job)
        kept = "warm ranks of an earlier trial" if reused else "warm ranks, kept for the next trial"
        log.info("%s (%s)", plan.describe(), kept)
        results = ranks.run(plain_dict(cfg), str(output_dir), log_file, environ)
    except RanksFailed as err:
        rank, message = first_cause(err.failures)
        rank_log = output_dir / WARM_LOGS / str(rank) / "stderr.log"
        where = f" (log: {rank_log})" if rank_log.exists() else ""
        raise RunFailed(rank_failure(rank, message) + where, failure_kind(message)) from None
    except SignalException as err:  # an elastic run earlier in this process left torch's handlers installed
        _stop_on_signal(err)
    return {**results[0], "warm_ranks": reused}
