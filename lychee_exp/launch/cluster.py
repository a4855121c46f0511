"""Where a job runs: one machine, ranks started by torchrun, or a SLURM allocation of several nodes.

On SLURM the project runs ONE task per node (`srun --ntasks-per-node=1`, or hydra-submitit-launcher's
`tasks_per_node: 1`). Each task runs the Hydra job once and starts its node's ranks with torch's elastic agent;
the agents rendezvous (c10d) at the first host of SLURM_JOB_NODELIST, on a port derived from the job id. So the
user never writes a torchrun line, each node has one Hydra job (one log, one preflight), and a rank that dies
takes its node's agent, and through the collectives the whole job, down (README: "Scaling out").
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from lychee_exp.errors import UserError

TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE")
PORT_BASE, PORT_SPAN = 20000, 20000  # rendezvous ports derived from SLURM job ids stay in [20000, 40000)


@dataclass(frozen=True)
class NodeSpec:
    """This node's place in a multi-node job whose agents the project starts itself."""

    nnodes: int
    node_rank: int
    endpoint: str  # host:port of the c10d rendezvous (the first node)
    run_id: str  # the same on every node of the job
    hosts: tuple[str, ...]

    def node_name(self, rank: int) -> str:
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        return f"node {rank} ({host})"


def under_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    return all(name in environ for name in TORCHRUN_VARS)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list, e.g. `gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}")
    return hosts


def slurm_nodes(environ: Mapping[str, str] = os.environ) -> NodeSpec | None:
    """The multi-node spec of the SLURM step this process runs in; None outside SLURM or on one node (then the
    ranks are started locally, as on any machine)."""
    if "SLURM_JOB_ID" not in environ or under_torchrun(environ):
        return None
    nnodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    tasks = int(environ.get("SLURM_NTASKS") or nnodes)
    if tasks > nnodes:
        raise UserError(
            f"this SLURM step runs {tasks} tasks on {nnodes} node(s): lychee_exp starts each node's ranks "
            "itself; run one task per node (srun --ntasks-per-node=1, hydra.launcher.tasks_per_node=1)"
        )
    if nnodes == 1:
        return None
    hosts = tuple(expand_nodelist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""))
    if not hosts:
        raise UserError("SLURM_JOB_NODELIST is empty: cannot find the first node of the job for the rendezvous")
    job = environ.get("SLURM_ARRAY_JOB_ID") and f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    job = job or environ["SLURM_JOB_ID"]
    # a requeued job is a new rendezvous: stale state of the killed attempt must not be joined
    run_id = f"slurm-{job}-{environ.get('SLURM_RESTART_COUNT', '0')}"
    port = int(environ.get("MASTER_PORT") or PORT_BASE + int(re.sub(r"\D", "", job) or 0) % PORT_SPAN)
    master = environ.get("MASTER_ADDR") or hosts[0]
    return NodeSpec(nnodes, int(environ.get("SLURM_NODEID", 0)), f"{master}:{port}", run_id, hosts)


def is_main_process(environ: Mapping[str, str] = os.environ) -> bool:
    """The one process of a job that writes its outputs: global rank 0 under torchrun, the first node's job
    under SLURM, else this process."""
    if under_torchrun(environ):
        return environ["RANK"] == "0"
    spec = slurm_nodes(environ)
    return spec is None or spec.node_rank == 0


def local_ranks(environ: Mapping[str, str] = os.environ) -> int | None:
    """Ranks on this node when torchrun started them (None otherwise)."""
    return int(environ["LOCAL_WORLD_SIZE"]) if under_torchrun(environ) and "LOCAL_WORLD_SIZE" in environ else None


def job_devices(node_devices: int, environ: Mapping[str, str] = os.environ) -> int:
    """The devices of the whole job whose node has `node_devices`: torchrun's WORLD_SIZE, or every SLURM node's
    share (each node starts as many ranks as this one), before any process group exists."""
    if under_torchrun(environ):
        return int(environ["WORLD_SIZE"])
    spec = slurm_nodes(environ)
    return node_devices * (spec.nnodes if spec else 1)
