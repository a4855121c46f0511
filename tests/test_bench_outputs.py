"""Where the benchmarks write (`--out`), by the output policy of every command (docs/outputs.md), through the one
shared place, benchmarks.harness.bench_output:
- the scaling benchmark (`python -m benchmarks`) in this process with its measurement replaced (a fake that
  writes what the real one writes): an earlier --out is refused without --overwrite and replaced whole with it,
  never merged; a directory holding anything else (notes, a finished run, a model) is never replaced; every path
  that names no writable local directory is one line; all of it before anything is measured;
- every other benchmark with --out (peers, own_batching, sweep_overhead, sweep_throughput) refuses the same way,
  so none of them writes around the shared place;
- the real command line in a subprocess: `bench model=nosuch` (one line with the options, exit 2, nothing
  written), a real measurement replacing an earlier --out, and Ctrl-C / SIGTERM during one (130 / 143, one line,
  the earlier --out byte for byte as it was, no process or temporary left);
- errors.command_main, which every command's main ends through.
Wrong code that would still pass is said beside a guard where it is not obvious."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
from conftest import TINY_OVERRIDES, output_lines, run_cli
from ddp_helpers import live_processes_in_group

from benchmarks import harness, scaling
from lychee_exp.errors import RunFailed, Terminated, UserError, command_main

# the cheapest real scaling benchmark: one device, one timed step, nothing logged
CHEAP_BENCH = ["gpus=1", "model=tiny_lychee", "data.max_train_queries=8", "logger=none", "--steps", "1"]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under root, hidden ones included: a refused or interrupted
    command must leave exactly this."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def leftovers(where: Path) -> list[str]:
    """Staging and set-aside directories and lock files of any output under where (none once a command ended)."""
    return sorted(p.name for p in where.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name or p.suffix == ".lock")


def earlier_bench(out: Path) -> Path:
    """An --out as an earlier scaling benchmark left it, on 1 and 2 devices."""
    for count in (1, 2):
        (out / f"devices_{count}").mkdir(parents=True)
        (out / f"devices_{count}" / "metrics.json").write_text(f'{{"train_samples_per_s": {count}0.0}}\n')
    (out / "bench.csv").write_text("devices,samples_per_s\n1,10.0\n2,20.0\n")
    (out / "bench.png").write_bytes(b"\x89PNG earlier")
    return out


def interrupt(
    cmd: list[str], ready: Callable[[str, int], bool], sig: int = signal.SIGINT, cwd: Path | None = None
) -> tuple[int, str]:
    """Runs cmd in a process group of its own and sends sig to the whole group, as a terminal's Ctrl-C does, once
    ready(what it printed so far, its pid) holds; its exit status and everything it printed. Asserts that no process of
    the group outlives it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        try:
            while True:
                log.seek(0)
                if ready(log.read(), proc.pid):
                    break
                assert proc.poll() is None, f"ended before it was interrupted:\n{log.read()[-3000:]}"
                assert time.monotonic() < deadline, "never got ready"
                time.sleep(0.1)
            os.killpg(proc.pid, sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        time.sleep(0.5)
        assert live_processes_in_group(proc.pid) == []
        log.seek(0)
        return proc.returncode, log.read()


def said(output: str) -> list[str]:
    """What a command said besides its progress log lines."""
    return [line for line in output.splitlines() if line.strip() and "][INFO] - " not in line]


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A command's main run here hands Ctrl-C and SIGTERM to itself (errors.ctrl_c_raises): put pytest's back."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture
def fake_measure(monkeypatch) -> list[list[int]]:
    """scaling.measure replaced by what it writes (a run directory per device count) and returns (rows): the
    device counts of each call, so a test can say that nothing was measured."""
    calls: list[list[int]] = []

    def measure(counts: list[int], overrides: list[str], out: Path, steps: int) -> list[dict]:
        calls.append(counts)
        rows = []
        for count in counts:
            (out / f"devices_{count}").mkdir()
            (out / f"devices_{count}" / "metrics.json").write_text('{"train_samples_per_s": 99.0}\n')
            figures = {"samples_per_s": 99.0 * count, "speedup": count, "efficiency": 1.0, "data_wait_share": 0.0}
            rows.append({"devices": count, **figures, "rank_time_spread": 1.0, "peak_memory_mb": 1.0})
        return rows

    monkeypatch.setattr(scaling, "measure", measure)
    return calls


def bench(capsys, *args: str) -> tuple[int, list[str]]:
    """`python -m benchmarks gpus=1 logger=none <args>` in this process: exit status, lines on stderr."""
    code = scaling.main(["gpus=1", "model=tiny_lychee", "logger=none", *args])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished training run (through the real command line: its directory as a user has it), with model/."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = run_cli([*TINY_OVERRIDES, "trainer.max_steps=1"], run_dir)
    assert proc.returncode == 0, output_lines(proc)[-10:]
    assert (run_dir / "metrics.json").is_file() and (run_dir / "model" / "config.json").is_file()
    return run_dir


# --------------------------------------------------------------------------------- scaling, in this process
def test_an_earlier_bench_dir_is_refused_without_overwrite_and_replaced_whole_with_it(tmp_path, capsys, fake_measure):
    out = earlier_bench(tmp_path / "bench")
    before = tree(tmp_path)
    code, lines = bench(capsys, "--out", str(out))
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --out={out} already holds results"), lines
    assert "--overwrite" in lines[0] and fake_measure == []  # refused before measuring anything
    assert tree(tmp_path) == before

    code, lines = bench(capsys, "--out", str(out), "--overwrite")
    assert code == 0 and lines == [] and fake_measure == [[1]]
    # replaced whole: devices_2 of the earlier benchmark is gone (a merge into the old directory would keep it)
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.png", "devices_1"]
    assert (out / "bench.csv").read_text().splitlines()[1].startswith("1,99.0,")
    assert (out / "devices_1" / "metrics.json").read_text() == '{"train_samples_per_s": 99.0}\n'
    assert leftovers(tmp_path) == []


def test_overwrite_never_replaces_a_directory_holding_anything_else(tmp_path, capsys, fake_measure):
    out = earlier_bench(tmp_path / "bench")
    (out / "notes.txt").write_text("what I found\n")
    before = tree(tmp_path)
    code, lines = bench(capsys, "--out", str(out), "--overwrite")
    assert code == 2 and len(lines) == 1 and "notes.txt" in lines[0] and lines[0].startswith(f"error: --out={out}")
    assert tree(tmp_path) == before and fake_measure == []


@pytest.mark.parametrize(
    "where",
    [
        lambda run: run,  # a finished run: its metrics.json, model/, logs are no benchmark's results
        lambda run: run / "model",  # a model directory
        lambda run: run / "model" / "x",  # inside a model (the output policy: never inside a model or a dataset)
        lambda run: run / "metrics.json",  # one of a run's files (nothing of a run is replaced)
    ],
    ids=["a-run", "a-model", "inside-a-model", "a-runs-file"],
)
@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
def test_a_run_or_model_directory_is_never_written(finished_run, capsys, fake_measure, where, overwrite):
    out = where(finished_run)
    before = tree(finished_run.parent)
    code, lines = bench(capsys, "--out", str(out), *(["--overwrite"] if overwrite else []))
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --out={out}"), lines
    assert tree(finished_run.parent) == before and fake_measure == []


def test_a_new_directory_inside_a_run_leaves_the_runs_files_as_they_were(finished_run, capsys, fake_measure):
    """A new output beside a run's own files loses nothing (the report's default page lands there too); the run's
    files stay byte for byte."""
    before = tree(finished_run)
    code, lines = bench(capsys, "--out", str(finished_run / "bench"))
    assert code == 0, lines
    after = tree(finished_run)
    assert {k: v for k, v in after.items() if not k.startswith("bench")} == before and "bench/bench.csv" in after


def _read_only_parent(tmp_path: Path) -> Path:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    locked.chmod(0o555)  # whatever the umask; root may write into it anyway: the command must not
    return locked / "bench"


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        (lambda t: str(t / "afile"), "is a file"),
        (lambda t: "", "--out= is empty"),
        (lambda t: "pkg://lychee_exp.assets/bench", "an output is a local path"),
        (lambda t: str(_read_only_parent(t)), "is not writable"),
        (lambda t: str(t / ("b" * 300)), ""),  # a name longer than a file system takes (255 bytes)
    ],
    ids=["a-file", "empty", "pkg", "read-only-parent", "name-too-long"],
)
def test_an_out_that_names_no_writable_directory_is_one_line(tmp_path, capsys, fake_measure, out, expected):
    (tmp_path / "afile").write_text("mine\n")
    spec = out(tmp_path)
    before = tree(tmp_path)
    code, lines = bench(capsys, "--out", spec)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --out={spec}") and expected in lines[0]
    assert tree(tmp_path) == before and fake_measure == []  # nothing created, in the read-only directory neither


def test_the_default_out_is_a_fresh_directory(tmp_path, monkeypatch):
    """Two benchmarks started in the same second get two directories (the default never names earlier results)."""

    class FrozenClock:
        @staticmethod
        def now():
            from datetime import datetime

            return datetime(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(harness, "datetime", FrozenClock)
    monkeypatch.chdir(tmp_path)
    first = harness.fresh_out("bench")
    assert first == "outputs/bench/2026-01-02_03-04-05" and not Path(first).exists()  # nothing created yet
    Path(first).mkdir(parents=True)
    assert harness.fresh_out("bench") == "outputs/bench/2026-01-02_03-04-05-2"


# ------------------------------------------------------------------ every benchmark with --out goes through it
def _peers(argv):
    from benchmarks import peers

    return peers.main(argv)


def _own_batching(argv):
    from benchmarks import own_batching

    return own_batching.main(argv)


def _from_sys_argv(module: str) -> Callable[[list[str]], int]:
    """The main of a benchmark that reads sys.argv (the test restores it)."""

    def main(argv: list[str]) -> int:
        sys.argv = [module, *argv]
        return importlib.import_module(f"benchmarks.{module}").main()

    return main


@pytest.mark.parametrize(
    "main",
    [_peers, _own_batching, _from_sys_argv("sweep_overhead"), _from_sys_argv("sweep_throughput")],
    ids=["peers", "own_batching", "sweep_overhead", "sweep_throughput"],
)
def test_every_benchmark_refuses_an_out_it_may_not_replace_before_measuring(tmp_path, capsys, monkeypatch, main):
    """Each would fail at once if it measured (no such model): the refusal comes first, in one line. Wrong code
    that would still pass: a benchmark writing into --out directly (it would have measured, and failed otherwise)."""
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    monkeypatch.setenv("LYCHEE_BASELINE_FILE", str(tmp_path / "baselines.json"))
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "notes.txt").write_text("mine\n")
    before = tree(tmp_path)
    for extra in ([], ["--overwrite"]):
        code = main(["--out", str(earlier), *extra, "model.path=/nonexistent"])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --out={earlier}"), lines
        assert tree(tmp_path) == before


# --------------------------------------------------------------------------------- the real command line
def test_bench_with_an_unknown_model_names_the_options_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "model=nosuch"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = output_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: model=nosuch: no such option") and "tiny_lychee" in lines[0]
    assert list(tmp_path.iterdir()) == []  # before anything: no outputs/bench/<time>


def test_a_real_benchmark_replaces_its_earlier_results_whole(tmp_path):
    out = earlier_bench(tmp_path / "bench")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *CHEAP_BENCH, "--out", str(out), "--overwrite"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, output_lines(proc)[-10:]
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.png", "devices_1"]
    assert (out / "devices_1" / "metrics.json").is_file() and (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {out}/bench.csv" in proc.stdout and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("sig", "code", "words"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stopped_benchmark_leaves_its_earlier_out_as_it_was(tmp_path, sig, code, words):
    """Stopped while it measures (its first run directory exists in the staging directory): one line, the shell's
    exit status, the earlier --out byte for byte, no staging directory, no rank left."""
    out = earlier_bench(tmp_path / "bench")
    before = tree(tmp_path)
    started = lambda printed, pid: bool(list(tmp_path.glob(".bench.*.tmp-*/devices_1")))  # noqa: E731
    cmd = [sys.executable, "-m", "benchmarks", *CHEAP_BENCH, "--out", str(out), "--overwrite"]
    status, output = interrupt(cmd, started, sig, cwd=tmp_path)
    assert status == code and said(output) == [f"{words}; {out} left as it was"], output
    assert "Traceback" not in output
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "command",
    [["benchmarks", *CHEAP_BENCH], ["lychee_exp.report", "runs"], ["benchmarks.gpu_check", "--tiny"]],
    ids=["bench", "report", "gpu_check"],
)
def test_ctrl_c_while_a_command_still_imports_is_one_line(tmp_path, command):
    """Ctrl-C once numpy is loaded: lychee_exp/__init__ has run, the command's main has not (torch and matplotlib
    take seconds more). One line, exit 130, nothing written (before: a KeyboardInterrupt traceback)."""

    def importing(_: str, pid: int) -> bool:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()

    code, output = interrupt([sys.executable, "-m", *command, "--out", str(tmp_path / "out")], importing, cwd=tmp_path)
    assert code == 130 and len(said(output)) == 1 and said(output)[0].startswith("interrupted"), output
    assert "Traceback" not in output and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (UserError("--out=x: wrong"), 2, "error: --out=x: wrong"),
        (RunFailed("rank 1 failed", "crashed"), 1, "error: rank 1 failed"),
        (KeyboardInterrupt(), 130, "interrupted; x left as it was"),
        (Terminated(), 143, "terminated (SIGTERM); x left as it was"),
    ],
    ids=["user-mistake", "failed", "ctrl-c", "sigterm"],
)
def test_every_command_ends_in_one_line_and_the_shells_exit_status(raised, code, line):
    def command():
        raise raised

    lines: list[str] = []
    assert command_main(command, lambda: "interrupted; x left as it was", lines.append) == code
    assert lines == [line]
    assert command_main(lambda: None, lambda: "", lines.append) == 0 and lines == [line]  # nothing said
