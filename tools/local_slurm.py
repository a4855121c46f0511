"""A throwaway Slurm cluster on this host for the SLURM tests and for trying the cluster paths (docs/cluster.md).

Debian's slurm-wlm 22.05 (slurmctld, slurmd, the client commands) and munge: a private munged (its own key and
socket), one slurmctld and one slurmd per node name. A single slurmd binary serves several node names on one host
(`slurmd -N <name>`, each with its own port, spool directory and pid file), so the host's CPUs are split over
`nodes` node names and a job of two nodes really is two slurmd and two srun tasks. Everything lives in one
temporary directory: slurm.conf, munge key and socket, state, spool, pid and log files; the client commands find
the cluster through SLURM_CONF (`cluster.env`). Ports are picked free; every wait is bounded and says what it
waited for with the daemons' logs; at the end every job is cancelled and the daemons, the job steps and the jobs'
processes (found by this cluster's SLURM_CONF in their environment) are stopped by their pids.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from lychee_exp.errors import UserError
from lychee_exp.launch.processes import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
INSTALL = "apt-get install -y slurm-wlm munge"
# A requeued job may start again once its step credential expired (Slurm's default: 120 s); 10 s here.
CRED_EXPIRE_S = 10


def _which(name: str) -> str | None:
    """`name` on PATH, or in /usr/sbin (the daemons' place, off a plain user's PATH)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def missing_binaries() -> list[str]:
    """The Slurm/munge programs this host lacks (empty: local_slurm can start)."""
    return [name for name in (*DAEMONS, *COMMANDS, "munge") if _which(name) is None]


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    nodes: tuple[str, ...]
    cpus_per_node: int
    env: dict = field(repr=False, default_factory=dict)  # os.environ + SLURM_CONF: run the commands with it

    def run(self, *cmd: str, timeout: float = 60, check: bool = True) -> str:
        """A Slurm command against this cluster; its stdout."""
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}\n{self.logs()}")
        return proc.stdout

    def jobs(self) -> list[str]:
        """`<id> <state>` of every job slurmctld still knows (finished ones for MinJobAge seconds)."""
        return self.run("squeue", "-h", "-t", "all", "-o", "%i %T").split("\n")[:-1]

    def wait_for(self, what: str, ready, timeout: float, interval: float = 0.5):
        """Polls `ready()` until it returns something true; a RuntimeError with the daemons' logs after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not (result := ready()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"local Slurm: {what} not within {timeout:.0f} s\n{self.logs()}")
            time.sleep(interval)
        return result

    def logs(self, lines: int = 30) -> str:
        """The tails of the daemons' logs, for failure messages."""
        parts = []
        for path in sorted(self.root.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(parts)


def _hostname() -> str:
    return socket.gethostname().split(".")[0]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 4096


def write_conf(root: Path, nodes: tuple[str, ...], cpus_per_node: int, memory_mb: int) -> Path:
    ctld_port, slurmd_port, *node_ports = (free_port() for _ in range(2 + len(nodes)))
    lines = [
        "ClusterName=lychee-local",
        f"SlurmctldHost={_hostname()}(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.sock'},cred_expire={CRED_EXPIRE_S}",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        # no cgroups (containers rarely delegate them): processes tracked by parentage, no CPU binding
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",  # no slurmdbd: sacct answers "disabled"
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",  # the node names share the host's CPUs as configured below
        "ReturnToService=2",
        "KillWait=5",  # SIGTERM -> SIGKILL of a cancelled or requeued job (default 30 s)
        "MinJobAge=600",  # finished jobs stay visible to squeue/scontrol for the tests
        "SchedulerType=sched/backfill",
        # a requeued job becomes eligible after cred_expire; the main loop (default: every 60 s) then starts it
        "SchedulerParameters=sched_interval=2,bf_interval=2",
    ]
    for name, port in zip(nodes, node_ports):
        lines.append(
            f"NodeName={name} NodeHostname={_hostname()} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={cpus_per_node} RealMemory={memory_mb} State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _job_processes(marker: bytes) -> list[int]:
    """Pids of this cluster's job steps (slurmstepd) and the processes under them: those whose environment holds
    `marker` (this cluster's SLURM_CONF=...) and whose parents, up to a slurmstepd, hold it too. A user's shell
    that exported the same SLURM_CONF is not among them."""
    parent, steps = {}, set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if (entry / "cmdline").read_bytes().startswith(b"slurmstepd"):
                steps.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue

    def under_a_step(pid: int) -> bool:
        for _ in range(64):  # a chain of parents, not a loop
            if pid in steps:
                return True
            if pid not in parent:
                return False
            pid = parent[pid]
        return False

    return [pid for pid in parent if under_a_step(pid)]


def _stop(pids: list[int], timeout: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.1)


def _start_daemons(cluster: SlurmCluster) -> None:
    root, env = cluster.root, cluster.env
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge = [f"--{k}={root / v}" for k, v in (("socket", "munge.sock"), ("key-file", "munge.key"))]
    munge += [f"--{k}={root / v}" for k, v in (("log-file", "munged.log"), ("pid-file", "munged.pid"))]
    munge += [f"--seed-file={root / 'munged.seed'}"]

    def start(*cmd: str) -> None:
        proc = subprocess.run([_which(cmd[0]), *cmd[1:]], env=env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:  # the daemons fork once they have read their configuration
            raise RuntimeError(f"{cmd[0]} did not start ({proc.returncode}): {proc.stderr.strip()}\n{cluster.logs()}")

    start("munged", *munge)
    sock = str(root / "munge.sock")
    cluster.wait_for(
        "munged answering", lambda: subprocess.run(["munge", "-n", "-S", sock], capture_output=True).returncode == 0, 30
    )
    start("slurmctld", "-f", str(cluster.conf))
    cluster.wait_for("slurmctld answering", lambda: cluster.run("sinfo", "-h", check=False, timeout=20), 60)
    for name in cluster.nodes:
        start("slurmd", "-f", str(cluster.conf), "-N", name)

    def all_idle() -> bool:
        states = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=20).split()
        return states[1::2] == ["idle"] * len(cluster.nodes)

    cluster.wait_for(f"{len(cluster.nodes)} node(s) idle in sinfo", all_idle, 90)


def _teardown(cluster: SlurmCluster) -> None:
    jobs = [line.split()[0] for line in cluster.jobs()] if (cluster.root / "slurmctld.pid").exists() else []
    if jobs:
        cluster.run("scancel", *jobs, check=False, timeout=30)
        deadline = time.monotonic() + 30
        active = ("RUNNING", "PENDING", "COMPLETING", "REQUEUED", "CONFIGURING", "SUSPENDED")
        while time.monotonic() < deadline and any(line.split()[1] in active for line in cluster.jobs()):
            time.sleep(0.5)
    # what could outlive the daemons: job steps (slurmstepd) and their processes, found while their parents live
    steps = _job_processes(f"SLURM_CONF={cluster.conf}".encode())
    daemons = [_pid(cluster.root / f"{n}.pid") for n in ("slurmctld", *(f"slurmd-{x}" for x in cluster.nodes))]
    _stop([pid for pid in daemons if pid], timeout=10)
    _stop(steps, timeout=10)
    munged = _pid(cluster.root / "munged.pid")
    _stop([munged] if munged else [], timeout=10)


def _new_cluster(nodes: int) -> SlurmCluster:
    root = Path(tempfile.mkdtemp(prefix="lychee-slurm-"))
    root.chmod(0o755)  # munged wants its socket's directory searchable by everyone
    names = tuple(f"node{k + 1}" for k in range(nodes))
    for path in ("state", "spool", *(f"spool/{name}" for name in names)):
        (root / path).mkdir()
    cpus = max(1, (os.cpu_count() or 1) // nodes)
    conf = write_conf(root, names, cpus, max(1, _memory_mb() // nodes))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return SlurmCluster(root, conf, names, cpus, {**env, "SLURM_CONF": str(conf)})


def _close(cluster: SlurmCluster) -> None:
    try:
        _teardown(cluster)
    finally:
        shutil.rmtree(cluster.root, ignore_errors=True)


@contextmanager
def local_slurm(nodes: int = 2, attempts: int = 2) -> Iterator[SlurmCluster]:
    """Starts munged, slurmctld and `nodes` slurmd on 127.0.0.1, each node with its share of this host's CPUs
    (at least one); yields the cluster once sinfo shows every node idle; cancels its jobs and stops every process
    it started after, failures included. A start that fails (a free port taken meanwhile) is cleaned up and
    tried again with new ports and directories, `attempts` times in all; the last failure is raised."""
    if nodes < 1:
        raise UserError(f"--nodes {nodes}: a cluster needs at least 1 node")
    missing = missing_binaries()
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing)} on this host ({INSTALL})")
    for attempt in range(1, attempts + 1):
        cluster = _new_cluster(nodes)
        try:
            _start_daemons(cluster)
            break
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            _close(cluster)
            if attempt == attempts:
                raise
            print(f"local Slurm: start {attempt} of {attempts} failed, trying again: {err}", file=sys.stderr)
        except BaseException:  # Ctrl-C or SIGTERM while starting: the daemons started so far go too
            _close(cluster)
            raise
    try:
        yield cluster
    finally:
        _close(cluster)


def main() -> None:
    """`python -m tools.local_slurm [--nodes N]`: a cluster to try the commands of docs/cluster.md
        on; prints the SLURM_CONF to export, runs until Ctrl-C (or SIGTERM, SIGHUP), then stops everything it started,
    also when stopped while it starts."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=main.__doc__)
    parser.add_argument("--nodes", type=int, default=2, help="node names on this host (they share its CPUs)")
    nodes = parser.parse_args().nodes
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop_requested)
    try:
        with local_slurm(nodes) as cluster:
            print(f"export SLURM_CONF={cluster.conf}", flush=True)
            print(cluster.run("sinfo", "-N"), end="", flush=True)
            print("Ctrl-C stops the cluster", file=sys.stderr, flush=True)
            while True:
                signal.pause()
    except StopRequested:
        pass  # everything it started is stopped: the end a user asks for
    except (UserError, FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"error: {err}", file=sys.stderr)  # a start that failed comes with the daemons' logs
        sys.exit(2 if isinstance(err, UserError) else 1)


class StopRequested(BaseException):
    """Ctrl-C, SIGTERM or SIGHUP (its terminal closed): the cluster is stopped through the finally clauses."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop_requested(signum, frame) -> None:
    for each in STOP_SIGNALS:  # a second signal must not cut the teardown short: it would leave daemons behind
        signal.signal(each, signal.SIG_IGN)
    raise StopRequested()


if __name__ == "__main__":
    main()
