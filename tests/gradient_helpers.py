"""Per-parameter gradients of a run's optimizer steps, in one process or on 2 spawned CPU ranks (gloo), before any
update: what test_token_budget (DDP) and test_fsdp (FSDP2, gradients gathered from the shards) compare."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import torch
from conftest import TINY_RANKS, compose_config

from lychee_exp.config.schema import to_run_config
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.train.trainer import Trainer


def trainer_for(tmp_path: Path, *overrides: str, env: DistEnv | None = None, strategy: str = "single") -> Trainer:
    """A set-up Trainer of the tiny Lychee path; on env's ranks, DDP (strategy single) or FSDP (fsdp)."""
    cfg = to_run_config(compose_config([*TINY_RANKS, "logger=none", *overrides], tmp_path))
    env = env or DistEnv()
    plan = plan_devices(strategy, env.world_size if strategy == "fsdp" else 1, cuda_count=0, cpu_threads_per_rank=1)
    trainer = Trainer(cfg, env, plan, tmp_path)
    trainer.setup()
    return trainer


def _full(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad  # fsdp: gathered from every rank's shard


def window_gradients(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Every window (optimizer step) of epoch 0: its gradient, before any update."""
    accum, n = trainer.cfg.trainer.grad_accum_steps, trainer.data.schedule.num_batches(0)
    result = []
    for first in range(0, n, accum):
        trainer.data.schedule.seek(0, first)
        micro = min(accum, n - first)
        trainer.step.accumulate(iter(trainer.data.loader), micro, trainer.data.schedule.loss_divisor(first, micro))
        grads = {k: _full(p.grad).clone() for k, p in trainer.model.named_parameters() if p.requires_grad}
        result.append(grads)
        trainer.model.zero_grad(set_to_none=True)
    return result


def _rank_gradients(rank: int, world: int, port: int, out: str, overrides: list[str], strategy: str) -> None:
    """One rank: its share of every window of epoch 0, gradients saved per window."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        env = DistEnv(rank, rank, world)
        trainer = trainer_for(Path(out) / f"rank{rank}", *overrides, env=env, strategy=strategy)
        with _counted_reductions() as reductions:
            grads = window_gradients(trainer)
        torch.save({"grads": grads, "reductions": reductions}, Path(out) / f"grads{rank}.pt")
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _counted_reductions():
    """Counts FSDP2's gradient reductions (foreach_reduce: one reduce-scatter of one sharded module's gradients):
    a list whose length is the count."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups

    calls, reduce = [], groups.foreach_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce(*args, **kwargs)

    groups.foreach_reduce = counted
    try:
        yield calls
    finally:
        groups.foreach_reduce = reduce


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawned_gradients(tmp_path: Path, overrides: list[str], strategy: str = "single") -> list[list[dict]]:
    """Each of 2 ranks' window_gradients (DDP: averaged over ranks; fsdp: the gathered full gradients)."""
    return [rank["grads"] for rank in spawned_windows(tmp_path, overrides, strategy)]


def spawned_windows(tmp_path: Path, overrides: list[str], strategy: str = "single") -> list[dict]:
    """Each of 2 ranks' {"grads": window_gradients, "reductions": how many FSDP2 gradient reductions ran}."""
    import torch.multiprocessing as mp

    args = (2, _free_port(), str(tmp_path), overrides, strategy)
    mp.start_processes(_rank_gradients, args=args, nprocs=2, start_method="spawn")
    return [torch.load(tmp_path / f"grads{r}.pt") for r in range(2)]
