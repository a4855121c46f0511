"""Which rank's failure to report when ranks fail together, and in which words.

When one rank fails, its peers fail too, moments later, with errors about closed sockets or a stopped process
group. The one line the user gets must name the rank that failed first for a reason of its own. Each failing
rank writes a note (when and why) as it fails; the launcher reads them beside what it saw itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from lychee_exp.launch.cluster import NodeSpec
from lychee_exp.tracking.memory import machine_memory_mb

FAILURE_NOTES = "logs/failures"

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


def failure_kind(message: str) -> str:
    if "TrainingDiverged" in message or "loss is nan" in message or "loss is inf" in message:
        return "diverged"
    if "out of memory" in message.lower() or "OutOfMemoryError" in message:
        return "oom"
    return "crashed"


def collateral(message: str) -> bool:
    return any(m in message for m in _COLLATERAL)


def first_cause(described: dict[int, tuple[float, str]]) -> tuple[int, str]:
    """{rank: (unix time, message)} -> the rank and message to report: the earliest failure that is not a
    consequence of another rank's."""
    ranked = sorted((collateral(message), stamp, rank, message) for rank, (stamp, message) in described.items())
    _, _, rank, message = ranked[0]
    return rank, message


def with_notes(described: dict[int, tuple[float, str]], notes: Path) -> dict[int, tuple[float, str]]:
    """The ranks' own notes (written as they failed) over what the launcher saw: a rank killed by a signal
    writes none, and the launcher's view fills that gap."""
    described = dict(described)
    for note in notes.glob("rank*.txt"):
        stamp, _, message = note.read_text().strip().partition("\t")
        described[int(note.stem[len("rank") :])] = (float(stamp), message)
    return described


KILLED = "killed by "  # how a message about a rank killed by a signal starts (rank_failure reads it)


def killed_by_signal(signum: int, pid: int | None, peak_mb: float | None) -> str:
    """What to say of a rank killed by a signal, which wrote no note of its own: the signal and, for SIGKILL, the
    likely cause, the rank's peak resident memory (watched from the launcher: launch.rank_memory) and the machine's
    memory, and the kernel's line on it where dmesg can be read."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    said = f"{KILLED}{name} (signal {signum})"
    if signum != signal.SIGKILL:
        return said
    kernel = _oom_kill_line(pid)
    cause = "by the kernel's out-of-memory killer" if kernel else "most likely by the kernel's out-of-memory killer"
    peak = f"it peaked at {peak_mb / 1024:.2f} GB resident" if peak_mb else "its peak memory was not seen"
    total, available = machine_memory_mb()
    said += f", {cause}: {peak} (the machine has {total / 1024:.0f} GB, {available / 1024:.1f} GB free now)"
    if kernel:
        return f"{said}; dmesg says: {kernel}"
    return f"{said}; `dmesg | grep -i 'killed process'` tells whether it was (else another process sent it)"


def _oom_kill_line(pid: int | None) -> str | None:
    """The kernel's out-of-memory line about pid ("Out of memory: Killed process <pid> (python) total-vm:...,
    anon-rss:..."), or None where there is none or dmesg cannot be read (containers, kernel.dmesg_restrict)."""
    if pid is None:
        return None
    try:
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line for line in kernel.splitlines() if f"Killed process {pid} " in line]
    return lines[-1].split("] ", 1)[-1].strip() if lines else None


def rank_failure(rank: int, message: str) -> str:
    """The one line of a failed rank: "rank 0 was killed by SIGKILL (signal 9), ..." or "rank 0 failed: ..."."""
    return f"rank {rank} was {message}" if message.startswith(KILLED) else f"rank {rank} failed: {message}"


def lost_nodes(nodes: NodeSpec, notes: Path, rank: int, message: str) -> str:
    """The one line for a rank that lost its peers: the nodes whose ranks left no failure note are the ones
    that went away (killed, preempted, or cut off)."""
    noted = {int(p.stem[len("node") :]) for p in notes.glob("node*")}
    lost = [nodes.node_name(k) for k in range(nodes.nnodes) if k != nodes.node_rank and k not in noted]
    return (
        f"lost {', '.join(lost) or 'another node'}: rank {rank} on {nodes.node_name(nodes.node_rank)} failed: {message}"
    )


# A rank whose peer died waits this long before it exits: the agent reports the one rank it sees exit first, and a
# rank killed by a signal writes no note to correct that, so the killed rank must be seen first.
COLLATERAL_GRACE_S = 1.0


def note_failure(output_dir: Path, rank: int, message: str) -> None:
    """Each failing rank writes when and why at once, before any teardown: the launcher then names the rank
    that failed first, not one that the agent happened to see exit first. A rank failing for a peer's sake
    then waits COLLATERAL_GRACE_S (the agent stops it sooner once it has seen the peer end)."""
    notes = output_dir / FAILURE_NOTES
    notes.mkdir(parents=True, exist_ok=True)
    (notes / f"rank{rank}.txt").write_text(f"{time.time():.6f}\t{message}\n")
    (notes / f"node{os.environ.get('SLURM_NODEID', '0')}").touch()  # this node was alive to write a note
    if collateral(message):
        time.sleep(COLLATERAL_GRACE_S)
