"""Nothing the user wrote is lost (io.outputs): mine and rerank refuse an out= that is or holds one of their
inputs, an out= with earlier results unless overwrite=true, a path they cannot write, and an out= another command
holds; an interrupted or failed command leaves the previous results byte for byte; bad bytes and doubtful qrels in
the user's files are one line naming file and line. Each case: one line, its exit code, every user file unchanged."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from beir_helpers import fruit_dataset
from ddp_helpers import live_processes_in_group

from lychee_exp import mine as mine_entry
from lychee_exp import rerank as rerank_entry
from lychee_exp.data.queries import load_queries
from lychee_exp.errors import RunFailed, Terminated, UserError
from lychee_exp.io.lock import OutputLock, short_name
from lychee_exp.io.outputs import resolved
from lychee_exp.ir.beir import read_beir_qrels

RERANK = ["model=tiny_lychee", "top_k=6", "batch_size=5", "progress_bar=false", "split=test"]
MINE = ["split=train", "teacher=none", "range_min=1", "range_max=10", "num_negatives=3", "progress_bar=false"]


def _command(which: str, root: Path, out: Path, *extra: str) -> list[str]:
    # the tiny preset is untrained: rerank scores it only when asked to, unless a model.path gives weights
    weights = which != "rerank" or any(e.startswith("model.path=") for e in extra)
    untrained = [] if weights else ["model.random_init=true"]
    return [f"dataset={root}", f"out={out}", *(RERANK if which == "rerank" else MINE), *untrained, *extra]


def _run(which: str, argv: list[str], capsys, caplog) -> tuple[int, list[str]]:
    """The command's exit code and the lines it printed or logged as errors."""
    main = rerank_entry.main if which == "rerank" else mine_entry.main
    caplog.clear()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    printed = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    return exit_.value.code, [line for line in printed if line.strip()]


def _user_files(tmp_path: Path) -> dict[str, bytes]:
    """Every file the user has under tmp_path (not the test's cache, not the lock files commands leave)."""
    return {
        str(p.relative_to(tmp_path)): p.read_bytes()
        for p in sorted(tmp_path.rglob("*"))
        if p.is_file() and "cache" not in p.relative_to(tmp_path).parts and not p.name.endswith(".lock")
    }


def _no_temporaries(tmp_path: Path) -> bool:
    # staging and set-aside directories, and lock files (removed when their command lets go of out=)
    return not [p for p in tmp_path.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name or p.suffix == ".lock"]


def _earlier_results(out: Path) -> Path:
    out.mkdir(parents=True)
    (out / "run.trec").write_text("q-apple Q0 apple-a 1 9.000000 earlier\n")
    (out / "metrics.json").write_text('{"ndcg@10": 0.5}\n')
    return out


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


# (command, a function of (tmp_path, dataset root) giving the extra arguments, what the one line says)
INPUTS_AS_OUT = {
    "corpus": ("mine", lambda t, r: [f"out={r / 'corpus.jsonl'}"], "an input of this command (corpus.jsonl of"),
    "queries": ("mine", lambda t, r: [f"out={r / 'queries.jsonl'}", "overwrite=true"], "queries.jsonl of"),
    "qrels": ("mine", lambda t, r: [f"out={r / 'qrels' / 'train.tsv'}", "overwrite=true"], "qrels/train.tsv of"),
    "dataset_dir": ("rerank", lambda t, r: [f"out={r}", "overwrite=true"], "(dataset="),
    "dataset_dir_as_file": ("mine", lambda t, r: [f"out={r}"], "would replace"),
    "corpus_via_symlink": ("mine", lambda t, r: [f"out={_link(t, r / 'corpus.jsonl')}"], "would replace"),
    "run_file": (
        "mine",
        lambda t, r: [f"out={t / 'bm25.trec'}", f"first_stage=run:{_run_file(t)}"],
        "would replace {t}/bm25.trec, an input of this command (first_stage=run:",
    ),
    "run_file_inside_out": (  # overwrite=true would replace the earlier run.trec, the input of this one
        "rerank",
        lambda t, r: [f"out={_earlier_results(t / 'p')}", f"first_stage=run:{t / 'p' / 'run.trec'}", "overwrite=true"],
        "run.trec, an input of this command (first_stage=run:",
    ),
    "model_dir": ("rerank", lambda t, r: [f"out={t / 'm'}", f"model.path={_model_dir(t / 'm')}"], "model.path="),
    # inside an input directory: a file of it that is no input itself (another split's qrels, a model's config)
    "other_split_qrels": ("mine", lambda t, r: [f"out={r / 'qrels' / 'dev.tsv'}", "overwrite=true"], "is inside"),
    "model_config": (
        "mine",
        lambda t, r: [f"out={t / 'm' / 'config.json'}", f"model.path={_model_dir(t / 'm')}", "overwrite=true"],
        "/m, an input of this command (model.path=",
    ),
    "model_inside_out": (
        "rerank",
        lambda t, r: [f"out={t / 'run'}", f"model.path={_model_dir(t / 'run' / 'model')}", "overwrite=true"],
        "model, an input of this command (model.path=",
    ),
}


def _link(tmp_path: Path, target: Path) -> Path:
    (tmp_path / "link.jsonl").symlink_to(target)
    return tmp_path / "link.jsonl"


def _run_file(tmp_path: Path) -> Path:
    (tmp_path / "bm25.trec").write_text("q-apple Q0 apple-a 1 9.000000 bm25\n")
    return tmp_path / "bm25.trec"


@pytest.mark.parametrize("case", INPUTS_AS_OUT)
def test_an_out_that_is_or_holds_an_input_is_refused(tmp_path, ir_cache, capsys, caplog, case):
    which, extra, expected = INPUTS_AS_OUT[case]
    root = fruit_dataset(tmp_path / "fruit")
    args = extra(tmp_path, root)
    before = _user_files(tmp_path)
    # the case's own out= comes after this placeholder, and the last value of a key wins
    code, lines = _run(which, _command(which, root, tmp_path / "placeholder", *args), capsys, caplog)
    assert code == 2 and len(lines) == 1 and expected.format(t=tmp_path) in lines[0] and "error: " in lines[0], lines
    assert _user_files(tmp_path) == before and _no_temporaries(tmp_path)


@pytest.mark.parametrize(
    ("which", "prepare", "extra", "expected"),
    [
        ("rerank", _earlier_results, [], "already holds results (metrics.json, run.trec): set overwrite=true"),
        ("mine", lambda out: out.write_text('{"query": "mine"}\n'), [], "already holds results (out): set overwrite"),
        (
            "rerank",
            lambda out: (_earlier_results(out) / "notes.txt").write_text("mine"),
            ["overwrite=true"],
            "holds files this command does not write (notes.txt)",
        ),
    ],
)
def test_earlier_results_are_kept_without_overwrite(
    tmp_path, ir_cache, capsys, caplog, which, prepare, extra, expected
):
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    prepare(out)
    before = _user_files(tmp_path)
    code, lines = _run(which, _command(which, root, out, *extra), capsys, caplog)
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert _user_files(tmp_path) == before and _no_temporaries(tmp_path)


@pytest.mark.parametrize(
    ("which", "out", "expected"),
    [
        ("rerank", lambda t: _touch(t / "results.txt"), "is a file; this command writes a directory"),
        ("mine", lambda t: _mkdir(t / "train"), "is a directory; this command writes a file"),
        ("mine", lambda t: _touch(t / "notes.txt") / "train.jsonl", "notes.txt is a file, not a directory"),
        ("rerank", lambda t: Path("/proc/no-such-dir/out"), "cannot create /proc/no-such-dir"),
        # read-only by its mode bits, which root's access ignores: refused for root too
        ("rerank", lambda t: _mkdir(t / "locked", 0o555) / "out", "is not writable"),
    ],
)
def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path, ir_cache, capsys, caplog, which, out, expected):
    root = fruit_dataset(tmp_path / "fruit")
    target = out(tmp_path)
    before = _user_files(tmp_path)
    code, lines = _run(which, _command(which, root, target), capsys, caplog)
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert _user_files(tmp_path) == before and _no_temporaries(tmp_path)


def _touch(path: Path) -> Path:
    path.write_text("the user's\n")
    return path


def _mkdir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


@pytest.mark.parametrize("which", ["mine", "rerank"])
def test_a_second_command_on_the_same_out_is_refused(tmp_path, ir_cache, capsys, caplog, which):
    """The test holds the lock a running command would hold: the second command stops at once."""
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    with OutputLock(resolved(str(out)), "a running command"):
        start = time.perf_counter()
        code, lines = _run(which, _command(which, root, out), capsys, caplog)
    assert code == 2 and len(lines) == 1 and f"out={out} is in use by another command" in lines[0], lines
    assert time.perf_counter() - start < 30 and not out.exists()  # not waiting for the first command


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _half_written_then(error: BaseException):
    """A stand-in for the scoring (rerank) or mining step that writes part of its result, then fails."""

    def step(*args, **kwargs):
        out = next((a for a in args if isinstance(a, Path)), None)
        target = out / "run.trec" if out.is_dir() else out
        target.write_text("half a result\n")
        raise error

    return step


@pytest.mark.parametrize(
    ("which", "error", "code", "expected"),
    [
        ("rerank", KeyboardInterrupt(), 130, "interrupted; {out} left as it was"),
        ("rerank", Terminated(), 143, "terminated (SIGTERM); {out} left as it was"),
        ("mine", KeyboardInterrupt(), 130, "interrupted; {out} left as it was"),
        ("mine", UserError("nothing to write: no query has a negative"), 2, "error: nothing to write"),
    ],
)
def test_a_command_that_stops_leaves_the_previous_results(
    tmp_path, ir_cache, capsys, caplog, monkeypatch, which, error, code, expected
):
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    _earlier_results(out) if which == "rerank" else out.write_text('{"query": "earlier"}\n')
    before = _user_files(tmp_path)
    if which == "rerank":
        monkeypatch.setattr(rerank_entry, "launch_rerank", _half_written_then(error))
    else:
        monkeypatch.setattr(mine_entry, "mine_to_file", _half_written_then(error))
    exit_code, lines = _run(which, _command(which, root, out, "overwrite=true"), capsys, caplog)
    assert exit_code == code and len(lines) == 1 and expected.format(out=out) in lines[0], lines
    assert _user_files(tmp_path) == before and _no_temporaries(tmp_path)


def test_a_failed_ddp_run_keeps_the_previous_results_and_the_log_its_line_names(
    tmp_path, ir_cache, capsys, caplog, monkeypatch
):
    root, out = fruit_dataset(tmp_path / "fruit"), _earlier_results(tmp_path / "out")
    before = _user_files(tmp_path)

    def failing_ranks(cfg, plan, staging):
        (staging / "logs").mkdir()
        (staging / "logs" / "stderr.log").write_text("Killed\n")
        raise RunFailed(f"rank 1 failed: Killed (log: {staging / 'logs' / 'stderr.log'})", "crashed")

    monkeypatch.setattr(rerank_entry, "launch_rerank", failing_ranks)
    code, lines = _run("rerank", _command("rerank", root, out, "overwrite=true"), capsys, caplog)
    assert code == 1 and len(lines) == 1 and "error: rank 1 failed: Killed (log: " in lines[0], lines
    assert Path(lines[0].split("(log: ")[1].rstrip(")")).read_text() == "Killed\n"
    assert {k: v for k, v in _user_files(tmp_path).items() if ".tmp-" not in k} == before


def test_ctrl_c_before_anything_was_written_says_so(tmp_path, ir_cache, capsys, caplog, monkeypatch):
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "new" / "out"
    monkeypatch.setattr(rerank_entry, "launch_rerank", _interrupt)
    code, lines = _run("rerank", _command("rerank", root, out), capsys, caplog)
    assert code == 130 and lines == [f"interrupted; nothing written to {out}"]
    assert not out.exists() and _no_temporaries(tmp_path)


def test_overwrite_replaces_earlier_results_with_complete_new_ones(tmp_path, ir_cache, capsys, caplog):
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "train.jsonl"
    mine_entry.main(_command("mine", root, out))
    assert [len(json.loads(line)["neg"]) for line in out.read_text().splitlines()] == [3] * 6
    mine_entry.main(_command("mine", root, out, "num_negatives=2", "overwrite=true"))
    assert [len(json.loads(line)["neg"]) for line in out.read_text().splitlines()] == [2] * 6
    results = _earlier_results(tmp_path / "reranked")
    rerank_entry.main(_command("rerank", root, results, "overwrite=true"))
    assert sorted(p.name for p in results.iterdir()) == ["metrics.json", "per_query.tsv", "run.trec", "timing.json"]
    assert len((results / "run.trec").read_text().splitlines()) == 6 * 6
    assert json.loads((results / "metrics.json").read_text())["pairs"] == 36
    assert _no_temporaries(tmp_path)


# ------------------------------------------------------------------------------------------------ the user's files
def _bad_byte(path: Path, line: int) -> None:
    """Latin-1 'é' (0xe9) in the middle of the given line: not UTF-8."""
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1] = lines[line - 1].replace(b"e", b"\xe9", 1)
    path.write_bytes(b"".join(lines))


@pytest.mark.parametrize(
    ("damage", "where"),
    [
        (lambda t, r: _bad_byte(r / "corpus.jsonl", 5), "corpus.jsonl:5: not UTF-8 (byte 0xe9"),
        (lambda t, r: _bad_byte(r / "queries.jsonl", 2), "queries.jsonl:2: not UTF-8"),
        (lambda t, r: _bad_byte(r / "qrels" / "train.tsv", 3), "train.tsv:3: not UTF-8"),
        (lambda t, r: _bad_byte(_run_file(t), 1), "bm25.trec:1: not UTF-8"),
    ],
)
def test_a_byte_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path, ir_cache, capsys, caplog, damage, where):
    root = fruit_dataset(tmp_path / "fruit")
    damage(tmp_path, root)
    stage = [f"first_stage=run:{tmp_path / 'bm25.trec'}"] if (tmp_path / "bm25.trec").exists() else []
    before = _user_files(tmp_path)
    code, lines = _run("mine", _command("mine", root, tmp_path / "out.jsonl", *stage), capsys, caplog)
    assert code == 2 and len(lines) == 1 and where in lines[0], lines
    assert _user_files(tmp_path) == before and not (tmp_path / "out.jsonl").exists()


def test_a_training_file_with_a_bad_byte_is_one_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"query": "q", "pos": ["p"]}\n{"query": "caf\xe9", "pos": ["p"]}\n')
    with pytest.raises(UserError, match=r"train.jsonl:2: not UTF-8 \(byte 0xe9 at byte 15 of the line\)"):
        load_queries(str(path), "data.train_file")


def test_a_byte_order_mark_is_not_part_of_the_first_id(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_bytes(b"\xef\xbb\xbfq1\td1\t1\n")
    assert read_beir_qrels(path) == {"q1": {"d1": 1}}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0\n", {"q1": {"d1": 1, "d2": 0}}),
        ("q1\td1\t2\nq1\td2\t0\n", {"q1": {"d1": 2, "d2": 0}}),  # no header: the first judgement stays
        ("q1\td1\t1\r\nq2\td2\t1\r\n", {"q1": {"d1": 1}, "q2": {"d2": 1}}),
    ],
)
def test_qrels_with_and_without_a_header_keep_every_judgement(tmp_path, text, expected):
    (tmp_path / "train.tsv").write_text(text, newline="")
    assert read_beir_qrels(tmp_path / "train.tsv") == expected


def test_a_first_judgement_with_a_fractional_grade_is_an_error_not_a_header(tmp_path):
    (tmp_path / "train.tsv").write_text("q1\td1\t1.5\nq1\td2\t1\n")
    with pytest.raises(UserError, match=r"train.tsv:1: expected 'query-id<TAB>corpus-id<TAB>score' with an integer"):
        read_beir_qrels(tmp_path / "train.tsv")


def test_a_document_judged_twice_is_one_line_naming_both_lines(tmp_path, ir_cache, capsys, caplog):
    root = fruit_dataset(tmp_path / "fruit")
    qrels = root / "qrels" / "train.tsv"
    qrels.write_text(qrels.read_text() + "q-apple\tapple-b\t2\n")
    before = _user_files(tmp_path)
    code, lines = _run("mine", _command("mine", root, tmp_path / "out.jsonl"), capsys, caplog)
    assert code == 2 and len(lines) == 1, lines
    assert f"{qrels}: query 'q-apple', document 'apple-b' is judged twice (lines 3 and 20)" in lines[0]
    assert _user_files(tmp_path) == before


# ------------------------------------------------------------------------------------------------------- Ctrl-C
def test_training_interrupted_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    from lychee_exp import run
    from lychee_exp.job import training_job

    monkeypatch.setattr(training_job, "train_job", _interrupt)  # run's task function imports it when it runs
    monkeypatch.setattr(sys, "argv", ["lychee-run", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"])
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with pytest.raises(SystemExit) as exit_:
            run.main()
    finally:  # Hydra's job logging writes to this test's captured stderr: later tests must not log into it
        root.handlers[:] = handlers
        root.setLevel(level)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 130 and lines == ["interrupted (Ctrl-C)"]


def test_ctrl_c_while_a_command_still_imports_is_one_line(tmp_path):
    """Time goes by importing before main() runs (Hydra, numpy; torch only once the config composed): lychee_exp/
    __init__ covers it for the commands. The signal comes once numpy is loaded: lychee_exp has been imported, and
    main() has not handed Ctrl-C back yet (it would only after composing the config)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.mine", f"out={tmp_path / 'out.jsonl'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while "_multiarray_umath" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)  # importing numpy (lychee_exp.mine's imports): lychee_exp/__init__ has run, main() has not
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and output == "interrupted (Ctrl-C) while starting; nothing written\n", output
    assert not list(tmp_path.iterdir())


def test_a_rank_that_the_launcher_starts_ends_silently_on_ctrl_c(tmp_path):
    """`import lychee_exp` with the variable launch.launcher.run_ranks sets for its ranks: exit 130, nothing
    printed (without it: a KeyboardInterrupt traceback)."""
    from lychee_exp.launch.launcher import QUIET_CTRL_C_ENV

    code = "import lychee_exp, sys, time; print('ready', flush=True); time.sleep(60)"
    for quiet, expected_code in (("1", 130), ("", -signal.SIGINT)):
        env = {**os.environ, QUIET_CTRL_C_ENV: quiet}
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == expected_code and (b"KeyboardInterrupt" in err) == (not quiet), err


@pytest.mark.slow
def test_ctrl_c_during_a_ddp_rerank_ends_every_rank_with_one_line(tmp_path, ir_cache):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group) while two ranks start or score: exit 130,
    one line and no traceback, no process left, the earlier results in out= unchanged."""
    root, out = fruit_dataset(tmp_path / "fruit"), _earlier_results(tmp_path / "out")
    before = _user_files(tmp_path)
    args = _command("rerank", root, out, "top_k=48", "batch_size=1", "overwrite=true", "parallel=ddp", "gpus=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lychee_exp.rerank", *args, "parallel.cpu_threads_per_rank=1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".out.*.tmp-*/logs/*")) and time.monotonic() < deadline:
        time.sleep(0.2)  # the launcher has started the ranks
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    lines = [line for line in output.splitlines() if line.strip() and "][INFO] - " not in line]
    assert proc.returncode == 130 and lines and lines[-1].endswith(f"interrupted; {out} left as it was"), output
    assert len(lines) == 1 and "Traceback" not in output, output
    time.sleep(1)
    assert live_processes_in_group(proc.pid) == []  # no rank outlives the command
    assert _user_files(tmp_path) == before and _no_temporaries(tmp_path)


@pytest.mark.parametrize(
    ("which", "spec", "expected"),
    [
        ("mine", "", "out= is empty: name the file to write"),
        ("rerank", " ", "out= is empty: name the directory to write"),
        ("mine", "pkg://lychee_exp.assets/mined.jsonl", "an output is a local path (pkg://"),
        ("mine", "{t}/mined/", "ends with '/', but this command writes a file"),
    ],
)
def test_an_out_naming_no_local_path_is_refused(tmp_path, ir_cache, capsys, caplog, monkeypatch, which, spec, expected):
    """An empty out= was the working directory itself (swapped for the results); pkg:// created a literal `pkg:`
    tree; a trailing slash wrote a file named like the directory. What would still pass: other URL schemes than
    `x://` (file:/x) are taken as relative paths."""
    root = fruit_dataset(tmp_path / "fruit")
    monkeypatch.chdir(tmp_path)
    before = _user_files(tmp_path)
    args = _command(which, root, tmp_path / "placeholder", f"out={spec.format(t=tmp_path)}")
    code, lines = _run(which, args, capsys, caplog)
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert _user_files(tmp_path) == before and not (tmp_path / "pkg:").exists() and _no_temporaries(tmp_path)


@pytest.mark.parametrize("which", ["mine", "rerank"])
def test_a_read_only_out_is_not_replaced_even_with_overwrite(tmp_path, ir_cache, capsys, caplog, which):
    """Mode bits without a write bit protect an output, also from root (whose access() ignores them). What would
    still pass: a read-only file inside a writable out= directory is replaced with the directory."""
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    _earlier_results(out) if which == "rerank" else out.write_text('{"query": "earlier"}\n')
    before = _user_files(tmp_path)
    out.chmod(0o555 if which == "rerank" else 0o444)
    try:
        code, lines = _run(which, _command(which, root, out, "overwrite=true"), capsys, caplog)
    finally:
        out.chmod(0o755 if which == "rerank" else 0o644)
    assert code == 2 and len(lines) == 1 and "is read-only: not replaced" in lines[0], lines
    assert _user_files(tmp_path) == before and _no_temporaries(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_get_the_permissions_of_the_users_umask(tmp_path, ir_cache, capsys, caplog, umask):
    """Staging directories came from mkdtemp (0700) and kept that mode once moved into place."""
    root = fruit_dataset(tmp_path / "fruit")
    previous = os.umask(umask)
    try:
        mine_entry.main(_command("mine", root, tmp_path / "mined.jsonl"))  # a failure would exit: SystemExit
        rerank_entry.main(_command("rerank", root, tmp_path / "reranked"))
    finally:
        os.umask(previous)
    assert (tmp_path / "mined.jsonl").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "reranked").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "reranked" / "run.trec").stat().st_mode & 0o777 == 0o666 & ~umask


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_killed_command_are_cleaned_and_set_aside_results_put_back(tmp_path, ir_cache, capsys, caplog):
    """A SIGKILLed command leaves its staging directory; one killed between the two renames of a replacement leaves
    the old results set aside and out= missing. The next command on out= holds its lock, so their owner is gone:
    staging removed, results back. A staging directory of a live process is never touched."""
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    short, dead = short_name(resolved(str(out))), _dead_pid()
    (tmp_path / f".{short}.tmp-{dead}-0000").mkdir()
    (tmp_path / f".{short}.tmp-{dead}-0000" / "run.trec").write_text("half\n")
    _earlier_results(tmp_path / f".{short}.old-{dead}-0000")
    live = tmp_path / f".{short}.tmp-{os.getpid()}-0000"
    live.mkdir()
    code, lines = _run("rerank", _command("rerank", root, out), capsys, caplog)
    assert code == 2 and "already holds results (metrics.json, run.trec)" in lines[0], lines
    assert (out / "run.trec").read_text().endswith("earlier\n")
    assert sorted(p.name for p in tmp_path.glob(".*")) == [live.name]  # and no lock file left


def test_an_out_name_as_long_as_the_file_system_takes_works(tmp_path, ir_cache, capsys, caplog):
    """`.<name>.lock` and `.<name>.tmp-*` beside a 250-byte name exceeded NAME_MAX (255): a traceback."""
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / ("m" * 244 + ".jsonl")
    mine_entry.main(_command("mine", root, out))  # a failure would exit: SystemExit
    assert out.stat().st_size > 0 and _no_temporaries(tmp_path)
