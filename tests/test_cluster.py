"""Beyond one process tree: SLURM variables, two "nodes" on 127.0.0.1 (torchrun agents, faked SLURM nodes) and
a node that dies. Preemption and damaged checkpoints: test_cluster_preemption; sweeps as submitit jobs and SLURM
array tasks: test_cluster_sweeps."""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from baselines import seed_baseline
from cluster_helpers import TINY_MULTI, cluster_env
from conftest import REPO_ROOT, run_metrics
from equivalence import assert_same_training

from lychee_exp.errors import Preempted, RunFailed, UserError
from lychee_exp.job.in_process import run_job
from lychee_exp.launch.cluster import expand_nodelist, is_main_process, job_devices, slurm_nodes
from lychee_exp.launch.processes import free_port
from lychee_exp.parallel.devices import available_cores


def _losses(run_dir: Path) -> list[float]:
    with (run_dir / "metrics.csv").open() as handle:
        return [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]


def _slurm_node(node: int, port: int, args: list[str], cwd: Path) -> subprocess.Popen:
    """One task of a faked 2-node SLURM step: the variables srun would set, both "hosts" being 127.0.0.1."""
    env = cluster_env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_NTASKS="2",
        SLURM_NODEID=str(node),
        SLURM_PROCID=str(node),
        SLURM_LOCALID="0",
        SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1",
        MASTER_PORT=str(port),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.run", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="module")
def in_process_ddp(tmp_path_factory) -> Path:
    """The reference: parallel=ddp gpus=2 launched in-process."""
    run_dir = tmp_path_factory.mktemp("ddp")
    run_job([*TINY_MULTI, "parallel=ddp", "gpus=2", "trainer.measure_speedup=false"], run_dir)
    return run_dir


def _assert_same_training(run_dir: Path, reference: Path) -> None:
    got, want = run_metrics(run_dir), run_metrics(reference)
    assert got["num_devices"] == want["num_devices"] == 2 and got["steps"] == 4
    assert _losses(run_dir) == pytest.approx(_losses(reference), abs=1e-5)
    # every step's pre-clip gradient norm too: a gradient off by a constant factor leaves the losses alone
    assert_same_training(run_dir, reference, weights=False)
    for key in ("initial_ndcg@10", "ndcg@10", "mrr@10"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key


# ------------------------------------------------------------------------------------------ SLURM variables
def test_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_slurm_variables_give_the_node_spec():
    env = {
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[10-13]",
    }
    spec = slurm_nodes(env)
    assert (spec.nnodes, spec.node_rank, spec.endpoint) == (4, 2, "gpu10:20123")
    assert spec.run_id == "slurm-123-0" and spec.node_name(1) == "node 1 (gpu11)"
    assert not is_main_process(env) and is_main_process({**env, "SLURM_NODEID": "0"})
    assert slurm_nodes({**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1"}) is None  # one node: local launch
    assert slurm_nodes({}) is None
    with pytest.raises(UserError, match="one task per node"):
        slurm_nodes({**env, "SLURM_NTASKS": "32"})
    # the job's devices, for trainer.global_batch_size before any rank joins: every node's, or torchrun's world
    assert job_devices(8, env) == 32 and job_devices(8, {}) == 8
    torchrun = {"TORCHELASTIC_RUN_ID": "r", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "16"}
    assert job_devices(2, torchrun) == 16


def test_errors_survive_pickling():
    """submitit hands a job's exception back to the sweeper by pickle: the failure kind must come with it."""
    import pickle

    for err in (RunFailed("rank 1 failed: x", "oom"), Preempted("stopped", "preempted")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.kind == err.kind


def test_requeue_pins_the_run_directory():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra_plugins.lychee_submitit_launcher.launchers import requeue_overrides

    got = requeue_overrides(["gpus=2", "trainer.resume=never", "hydra.sweep.dir=x"], "/runs/a b")
    assert got == ["gpus=2", "hydra.sweep.dir='/runs/a b'", "trainer.resume=auto"]


# ------------------------------------------------------------------------------------------- two "nodes"
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_torchrun_agents_match_in_process_ddp(tmp_path, in_process_ddp, monkeypatch, strategy):
    """Also the speedup baseline phase in ranks torchrun started: it runs (nothing cached) and leaves the
    training equal to the in-process run's, which had it off. fsdp: its shards over both agents train as DDP does,
    and no baseline is timed inside a sharded launch (the status says why)."""
    run_dir, port = tmp_path / "run", free_port()
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(tmp_path / "baselines.json"))
    args = [*TINY_MULTI, f"parallel={strategy}", f"hydra.run.dir={run_dir}"]
    args += ["trainer.global_batch_size=4"]  # 2 x 2 ranks over both agents: accumulation 1, as the reference
    agents = [
        subprocess.Popen(
            ["bash", str(REPO_ROOT / "launch/torchrun.sh"), *args],
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=cluster_env(
                NNODES="2",
                NODE_RANK=str(k),
                GPUS_PER_NODE="1",
                RUN_ID="two-agents",
                MASTER_PORT=str(port),
                PYTHON=sys.executable,
            ),
        )
        for k in range(2)
    ]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], [out[-3000:] for out in outputs]
    _assert_same_training(run_dir, in_process_ddp)
    m = run_metrics(run_dir)
    # one rank per agent: each takes the share of the cores the in-process rule gives one local rank
    assert m["cpu_threads_per_rank"] == available_cores() and m["strategy"] == strategy
    if strategy == "fsdp":
        assert len(m["optimizer_bytes_per_rank"]) == 2 and "speedup" not in m, m.get("speedup_status")
        return
    # nothing cached: rank 0 timed one device itself; a figure, or the reason there is none, on one line
    assert m["baseline_samples_per_s"] > 0 and ("speedup" in m) == (m["speedup_status"] == "measured")
    assert m.get("speedup", 0.0) <= 2 and m["speedup_status"].startswith(("measured", "unreliable"))
    assert sum("samples/s on 2 device(s)" in line and "speedup" in line for line in outputs[0].splitlines()) == 1


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_faked_slurm_nodes_match_in_process_ddp(tmp_path, in_process_ddp, monkeypatch, strategy):
    run_dir, port = tmp_path / "run", free_port()
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(tmp_path / "baselines.json"))
    args = [
        *TINY_MULTI,
        f"parallel={strategy}",
        "gpus=1",
        "parallel.cpu_threads_per_rank=1",
        f"hydra.run.dir={run_dir}",
        "trainer.global_batch_size=4",  # counted over both nodes' ranks: accumulation 1, as the reference
    ]
    seed_baseline(args, run_dir, 1000.0)  # a cached one-device figure: the ranks divide by it, measure none
    nodes = [_slurm_node(k, port, args, tmp_path) for k in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [out[-3000:] for out in outputs]
    _assert_same_training(run_dir, in_process_ddp)
    m = run_metrics(run_dir)
    assert m["num_processes"] == 2 and m["cpu_threads_per_rank"] == 1 and m["strategy"] == strategy
    assert m["speedup"] == pytest.approx(m["train_samples_per_s"] / 1000.0)  # the cached baseline


def test_a_killed_node_ends_the_other_with_one_line(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    args = [
        *TINY_MULTI,
        "parallel=ddp",
        "gpus=1",
        "parallel.cpu_threads_per_rank=1",
        "trainer.max_steps=100000",
        "trainer.evaluate=false",
        "trainer.measure_speedup=false",
        f"hydra.run.dir={run_dir}",
    ]
    nodes = [_slurm_node(k, port, args, tmp_path) for k in range(2)]
    deadline = time.monotonic() + 240
    log = run_dir / "logs"
    while not any("step 2/" in p.read_text() for p in log.glob("**/0/stderr.log")):
        assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "training did not start"
        time.sleep(0.3)
    nodes[1].send_signal(signal.SIGKILL)  # node 1's agent; its rank dies with it
    killed = time.monotonic()
    out, _ = nodes[0].communicate(timeout=120)
    elapsed = time.monotonic() - killed
    print(f"node 0 ended {elapsed:.1f} s after node 1's agent was killed")  # the figure, with pytest -s
    assert elapsed < 60
    assert nodes[0].returncode == 1
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "lost node 1 (127.0.0.1)" in errors[0], out[-3000:]
    assert "Traceback" not in out and not (run_dir / "metrics.json").exists()
