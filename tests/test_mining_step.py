"""data=beir without data.train_file: mining is the training job's named first step, in the Hydra process before
any rank starts (ir.training.prepare_beir), and so is scoring the dev split's candidates with the teacher. A check
(preflight, load_inputs, `--cfg job`) only reads: it never mines or scores, and refuses in one line with the `mine`
command. The log names each step and the file it writes; a second run says it reuses it; the ranks read the mined
file handed down as data.train_file; a process that needs the file while another mines it waits and reuses it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from beir_helpers import fruit_dataset
from conftest import TINY_OVERRIDES, TINY_RANKS, run_cli, run_metrics
from omegaconf import OmegaConf

from lychee_exp.config.choices import Stemmer
from lychee_exp.config.schema import DenseConfig, to_run_config
from lychee_exp.errors import UserError
from lychee_exp.io.lock import OutputLock
from lychee_exp.ir import training
from lychee_exp.ir.pipeline import mined_train_path, open_split
from lychee_exp.job.in_process import compose_job, run_job
from lychee_exp.job.training_job import preflight
from lychee_exp.mine import main as mine_main

FRUIT = ["data=beir", "data.dev_split=test", "data.rerank_top_k=5"]  # + data.dataset=<the fruit set>


def _files(cache) -> list[str]:
    """Every file in the cache, as <kind>/<name>."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def test_a_check_alone_mines_and_scores_nothing_and_says_the_mine_command(tmp_path, ir_cache):
    """The built-in set (data=beir's default dataset), cold cache. Before, preflight mined the train split (33 s
    here) and scored the dev split with the teacher inside the check."""
    cfg = to_run_config(compose_job(["data=beir", *TINY_OVERRIDES], tmp_path / "run"))
    assert cfg.data.dataset == "pkg://lychee_exp.assets/beir_sample" and cfg.data.train_file == ""
    with pytest.raises(UserError) as refused:
        preflight(cfg)
    line = str(refused.value)
    assert "\n" not in line and "split train is not mined yet (a check never mines)" in line
    command = "python -m lychee_exp.mine dataset=pkg://lychee_exp.assets/beir_sample split=train first_stage=bm25"
    assert f"`{command} out=train.jsonl` and pass data.train_file=train.jsonl" in line
    # reading the dataset caches its parsed corpus; nothing was retrieved, embedded, mined or scored
    assert all(name.startswith("corpus/") for name in _files(ir_cache)), _files(ir_cache)
    assert sorted(p.name for p in ir_cache.iterdir()) == ["corpus"]

    # a train file given: the dev split's candidates and teacher scores are still a step's, not a check's
    train = tmp_path / "train.jsonl"
    train.write_text('{"query": "q", "pos": ["p"], "neg": ["a", "b", "c"]}\n')
    given = to_run_config(compose_job(["data=beir", *TINY_OVERRIDES, f"data.train_file={train}"], tmp_path / "r2"))
    with pytest.raises(UserError, match=r"data.dev_split=dev: its bm25 top-100 and the teacher's scores of them are "):
        preflight(given)
    assert sorted(p.name for p in ir_cache.iterdir()) == ["corpus"]

    # `--cfg job` prints the config: it reads no dataset at all
    env = dict(os.environ, LYCHEE_CACHE_DIR=str(tmp_path / "cfg_cache"))
    shown = subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", "data=beir", "--cfg", "job"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0 and "train_file: ''" in shown.stdout, shown.stderr[-2000:]
    assert not (tmp_path / "cfg_cache").exists()


def test_the_log_names_the_mining_step_and_its_file_and_a_second_run_reuses_it(tmp_path, ir_cache):
    root = fruit_dataset(tmp_path / "fruit")
    args = [*TINY_OVERRIDES, *FRUIT, f"data.dataset={root}"]
    first = run_cli(args, tmp_path / "first")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    mined = ir_cache / "mined" / next(n for n in os.listdir(ir_cache / "mined") if n.endswith(".jsonl"))
    scored = ir_cache / "teacher" / os.listdir(ir_cache / "teacher")[0]
    lines = (first.stdout + first.stderr).splitlines()
    step1 = [line for line in lines if "data step 1/2:" in line]
    assert f"data step 1/2: mining hard negatives from split train of {root} (first_stage=bm25)" in step1[0]
    assert f"into {mined} (cached: later runs reuse it)" in step1[0]
    assert "data step 1/2: mined in " in step1[1] and "6 queries written" in step1[1]
    step2 = next(line for line in lines if "data step 2/2:" in line)
    assert "retrieving split test's bm25 top-5 (3 queries) and scoring it with the dense teacher" in step2
    assert str(scored) in step2
    # the steps come first, before anything trains; the run records the file it trained on
    assert lines.index(step1[0]) < lines.index(next(line for line in lines if "train queries" in line))
    assert OmegaConf.load(tmp_path / "first" / "config.yaml").data.train_file == str(mined)
    assert OmegaConf.load(tmp_path / "first" / ".hydra" / "config.yaml").data.train_file == ""  # as the user gave it
    stamp = mined.stat().st_mtime_ns

    second = run_cli(args, tmp_path / "second")
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    out = second.stdout + second.stderr
    assert f"data step 1/2: reusing {mined}, mined earlier from split train of {root}" in out
    assert "data step 2/2: reusing split test's bm25 top-5 (3 queries) and its teacher scores" in out
    assert "mining hard negatives" not in out and "retrieving split" not in out
    assert mined.stat().st_mtime_ns == stamp and _files(ir_cache).count(f"mined/{mined.name}") == 1


def test_the_refusals_mine_command_writes_the_file_the_step_would(tmp_path, ir_cache):
    """The command a check prints, run as printed (a stemmer and an encoder setting that are not the defaults
    among its keys), writes byte for byte what the job's mining step caches."""
    root = fruit_dataset(tmp_path / "fruit")
    given = [*FRUIT, f"data.dataset={root}", "data.bm25_stemmer=english", "data.dense.max_len=64"]
    cfg = to_run_config(compose_job([*given, *TINY_OVERRIDES], tmp_path / "run"))
    with pytest.raises(UserError) as refused:
        preflight(cfg)
    command = shlex.split(str(refused.value).split("`")[1])
    assert command[:3] == ["python", "-m", "lychee_exp.mine"] and command[-1] == "out=train.jsonl"
    assert "bm25_stemmer=english" in command and "dense.max_len=64" in command
    mine_main([*command[3:-1], f"out={tmp_path / 'train.jsonl'}", "progress_bar=false"])
    stepped = training.mine_train_split(cfg.data)
    assert stepped.read_bytes() == (tmp_path / "train.jsonl").read_bytes()


@pytest.mark.slow
def test_the_ranks_train_on_the_mined_file_handed_to_them(tmp_path, ir_cache, monkeypatch):
    """Two spawned DDP ranks, which load their own inputs. Once the steps have run, the job's cache is swapped for
    a copy without the mined file: the checks and the ranks can only train on the path handed down to them (before,
    each rank looked the file up, and mined it where it was missing)."""
    root = fruit_dataset(tmp_path / "fruit")
    copy = tmp_path / "copy"
    real = training.prepare_beir

    def steps_then_swap(data, *args):
        train_file = real(data, *args)
        shutil.copytree(ir_cache, copy, ignore=shutil.ignore_patterns("mined"))
        monkeypatch.setenv("LYCHEE_CACHE_DIR", str(copy))
        return train_file

    monkeypatch.setattr("lychee_exp.job.training_job.prepare_beir", steps_then_swap)
    overrides = [*TINY_RANKS, *FRUIT, f"data.dataset={root}", "parallel=ddp", "gpus=2", "trainer.max_steps=2"]
    _, metrics = run_job([*overrides, "parallel.cpu_threads_per_rank=1", "logger=none"], tmp_path / "run")
    mined = next((ir_cache / "mined").glob("*.jsonl"))
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").data.train_file == str(mined)
    assert metrics["num_processes"] == 2 and metrics["strategy"] == "ddp"
    assert "ndcg@10" in metrics and not (copy / "mined").exists()  # nobody mined (or looked) in the swapped cache


@pytest.mark.slow
def test_under_torchrun_one_rank_mines_and_the_other_reuses_its_file(tmp_path, ir_cache):
    """Under torchrun every rank is a Hydra process of its own and runs the job's steps: exactly one mines (and one
    scores the dev split); the other waits for it, or finds the file, and reuses it."""
    from lychee_exp.launch.processes import free_port

    root = fruit_dataset(tmp_path / "fruit")
    args = [*TINY_RANKS, *FRUIT, f"data.dataset={root}", "parallel=ddp", "trainer.max_steps=2", "logger=none"]
    args += ["parallel.cpu_threads_per_rank=1", f"hydra.run.dir={tmp_path / 'run'}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYTHONWARNINGS"))}
    done = subprocess.run(
        [*torchrun, "-m", "lychee_exp.run", *args],
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert out.count("data step 1/2: mining hard negatives") == 1 and out.count("data step 1/2: mined in") == 1
    assert out.count("data step 1/2: reusing") == 1 and out.count("data step 2/2: retrieving split test") == 1
    assert len(list((ir_cache / "mined").glob("*.jsonl"))) == 1
    assert run_metrics(tmp_path / "run")["num_processes"] == 2


def _train_data(root) -> SimpleNamespace:
    return SimpleNamespace(
        dataset=str(root), train_split="train", first_stage="bm25", dense=DenseConfig(), bm25_stemmer=Stemmer.porter
    )


def test_a_process_that_needs_the_file_while_another_mines_it_waits_and_reuses_it(tmp_path, ir_cache, caplog):
    """As every rank of a torchrun job, each a Hydra process of its own, runs the steps: one mines, the others wait.
    The test holds the mining lock as the process mining would, then writes the file itself."""
    root = fruit_dataset(tmp_path / "fruit")
    corpus, split = open_split(str(root), "train")
    path = mined_train_path(corpus, split, "bm25", DenseConfig())
    caplog.set_level("INFO", logger="lychee_exp")
    got = {}
    with OutputLock(path, str(path)):
        worker = threading.Thread(target=lambda: got.update(path=training.mine_train_split(_train_data(root))))
        worker.start()
        deadline = time.monotonic() + 60
        while "waiting for pid" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"waiting for pid {os.getpid()} on " in caplog.text and f"which is mining into {path}" in caplog.text
        assert worker.is_alive() and not path.exists()
        path.write_text('{"query": "written by the process it waited for"}\n')
    worker.join(60)
    assert got["path"] == path and "written by the process it waited for" in path.read_text()  # not mined again
    assert "reusing" in caplog.text and "mined meanwhile by the process it waited for" in caplog.text
    assert "mining hard negatives" not in caplog.text  # it never said it would mine


@pytest.mark.parametrize("where", ["mining", "rename"])
def test_ctrl_c_while_mining_leaves_no_file_and_no_lock(tmp_path, ir_cache, monkeypatch, where):
    """Ctrl-C while the split is mined, or once the whole file is written beside its place, just before the rename
    that puts it there: no entry, no temporary file, no lock is left, and the next run mines it whole."""
    root = fruit_dataset(tmp_path / "fruit")
    real_replace = os.replace

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith(".jsonl"):
            assert Path(src).read_text().count("\n") == 6  # the temporary file is whole
            raise KeyboardInterrupt
        return real_replace(src, dst, *args, **kwargs)

    with monkeypatch.context() as patch:
        if where == "mining":
            patch.setattr("lychee_exp.ir.pipeline.mine", interrupted)
        else:
            patch.setattr(os, "replace", replace)
        with pytest.raises(KeyboardInterrupt):
            training.mine_train_split(_train_data(root))
    assert os.listdir(ir_cache / "mined") == []
    path = training.mine_train_split(_train_data(root))
    assert len(path.read_text().splitlines()) == 6
