"""CPU ranks come from a forkserver started at an earlier launch: each takes its launcher's environment and
directory as they are at its own launch, and keeps what the elastic agent set for it. That a forked rank ends
with its killed launcher: tests/test_cluster.py's killed node (its rank would train on, and the other node hang)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lychee_exp.launch import rank_start
from lychee_exp.launch.rank_start import RankParent


def test_a_forked_rank_takes_the_launchers_environment_of_now_and_keeps_the_agents(tmp_path, monkeypatch):
    server = {"PATH": "/bin", "LYCHEE_FAULT": "1:2:raise", "OLD": "x"}  # the forkserver started with these
    launcher = {"PATH": "/bin", "NEW": "y", "OMP_NUM_THREADS": "1"}  # the launcher's now: the fault gone, NEW set
    agent = {"RANK": "1", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"}
    monkeypatch.setattr(os, "environ", {**server, **agent})  # what a fork of the forkserver sees after the agent
    monkeypatch.setattr(rank_start, "die_with_parent", lambda pid: None)
    monkeypatch.chdir(os.getcwd())  # adopt() changes directory: back to this one after the test
    RankParent(os.getpid(), launcher, server, str(tmp_path), launcher_pid=os.getpid()).adopt()
    assert os.environ == {**launcher, "RANK": "1", "MASTER_PORT": "29500"}
    assert os.getcwd() == str(tmp_path)


def test_cuda_ranks_are_spawned_and_cpu_ranks_forked_from_one_server():
    before = signal.getsignal(rank_start.PREEMPT_SIGNAL)
    method, parent = rank_start.rank_start("cuda")
    assert method == "spawn" and parent == RankParent(os.getpid())
    first_method, first = rank_start.rank_start("cpu")
    if first_method == "spawn":
        pytest.skip("this Python has no forkserver")
    _, second = rank_start.rank_start("cpu")
    assert first.pid == second.pid != os.getpid()  # the same server serves every launch of this process
    assert first.server_environ is second.server_environ and second.environ == dict(os.environ)
    assert second.launcher_pid == os.getpid()  # what a forked rank watches: the forkserver outlives a killed launcher
    # SLURM signals every process of the step: the server ignores the preemption notice, this process still has
    # its handler (a real Slurm's USR2 killed the server and its ranks: tests/test_cluster_slurm.py's preemption)
    status = Path(f"/proc/{first.pid}/status").read_text().splitlines()
    ignored = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored >> (rank_start.PREEMPT_SIGNAL - 1) & 1 and signal.getsignal(rank_start.PREEMPT_SIGNAL) is before
