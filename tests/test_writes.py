"""Every write of the product, read from the source (nothing is imported to find them): a call outside lychee_exp/io
(the output policy, atomic writes, locks) that writes, replaces or removes a file or a directory is one of the
sites listed in LISTED, each with its reason, and a listed site that is gone fails as well (no stale entries). A
command's output (out=, --out, hydra.run.dir, a file in a run directory the run's claim does not cover) that
bypasses io is routed through it, not listed.

The detector reads calls by name, resolving the module's imports (`np.save` is numpy.save, `save_file` imported
from safetensors.torch is safetensors.torch.save_file), and names each site by its file, its enclosing function
(`Class.method`, so that an entry survives the code moving within a file and a file's renaming is one edit) and
what it calls. What it finds (WRITE_CALLS, WRITE_METHODS): `open` and `Path.open` with a mode that writes, `os.open`
with a write flag, `Path.write_text`/`write_bytes`/`touch`/`mkdir`/`unlink`/`rmdir`/`rename`/`replace`/
`symlink_to`, the os and shutil functions that create, move or remove, tempfile's files and directories, torch,
numpy, safetensors, json and pickle dumps, any `.save(<args>)`, `.save_pretrained(`, `.savefig(`, and the library
writers given a path (logging's file handlers, W&B's init, TensorBoard's SummaryWriter, torch's elastic log specs,
optuna's RDBStorage, submitit's executor folder). What it does not see: a write through an alias
(`w = os.replace`) or a handle opened elsewhere (the open is the site), a subprocess writing through a shell
redirection or its own flags (out of scope), what a library writes beside what it is asked to (W&B's temp files),
os.chmod (modes only). Several calls of one kind in one function are one entry.

After code moves, both tests name what changed: a renamed or moved function is an unlisted site under its new key
and a stale one under its old; its reason moves with it (a merged module's entries go under the new file)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import lychee_exp
from lychee_exp.io.outputs import RUN_MARKER, RUN_NAMES

PACKAGE = Path(lychee_exp.__file__).resolve().parent
ROOT = PACKAGE.parent

# Functions that write, replace or remove, by their qualified name
WRITE_CALLS = {
    *(f"os.{name}" for name in ("replace", "rename", "renames", "remove", "unlink", "rmdir", "removedirs")),
    *(f"os.{name}" for name in ("mkdir", "makedirs", "symlink", "link", "truncate", "mkfifo")),
    *(f"shutil.{name}" for name in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree")),
    *(f"tempfile.{name}" for name in ("mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryFile")),
    "tempfile.SpooledTemporaryFile",
    "tempfile.TemporaryDirectory",
    "torch.save",
    *(f"numpy.{name}" for name in ("save", "savez", "savez_compressed", "savetxt")),
    "safetensors.torch.save_file",
    "safetensors.numpy.save_file",
    "json.dump",
    "pickle.dump",
    # library writers: a path in, files written there as they go
    "logging.FileHandler",
    *(f"logging.handlers.{name}" for name in ("RotatingFileHandler", "TimedRotatingFileHandler", "WatchedFileHandler")),
    "torch.utils.tensorboard.SummaryWriter",
    "wandb.init",
    "torch.distributed.elastic.multiprocessing.DefaultLogsSpecs",
    "optuna.storages.RDBStorage",
    "submitit.AutoExecutor",
}
# Methods that write whatever their object (a Path, a model, a figure); rename/replace only with one positional
# argument (Path's), which str.replace and dataclasses.replace never have; save only with an argument (a path)
WRITE_METHODS = {"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir", "symlink_to", "hardlink_to"}
WRITE_METHODS |= {"rename", "replace", "save", "save_pretrained", "savefig"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}

# Every write outside io, by file: (enclosing function, call) -> why it is not io's. "The run directory": a training
# run's (hydra.run.dir), checked and locked by its claim (job.run_dir, docs/outputs.md) before anything is written
# there; what a run writes at its top is one of io.outputs.RUN_NAMES (the last test).
LISTED = {
    # io's rules for a run's directory, carried out where Hydra's callback runs (io may import errors only)
    "lychee_exp/job/run_dir.py": {
        ("_decide", "os.replace"): "overwrite=true: the old run set aside beside it (hidden), under the run's lock",
        ("_mark", ".mkdir"): "the claimed run directory, created to carry the run's marker",
        ("_keep", ".mkdir"): "a continued run's kept files: a hidden companion of the run",
        ("_keep", "shutil.copytree"): "a continued run's .hydra/ copied aside until its checks pass",
        ("_put_kept_back", "os.truncate"): "a continued run's log cut back to its length when its checks failed",
        ("_put_kept_back", ".unlink"): "a log the failed attempt started",
        ("_put_kept_back", "shutil.rmtree"): "the failed attempt's .hydra/, then the kept copy",
        ("_put_kept_back", "os.replace"): "the kept .hydra/ put back",
        ("commit_run_dir", "shutil.rmtree"): "a continued run's kept files, once its checks passed",
        ("finish_run_dir", "shutil.rmtree"): "the run overwrite=true replaced, once the new one finished",
        ("_recover_replaced", "shutil.rmtree"): "a replaced run left by a process killed after its successor finished",
        ("_put_back", "shutil.rmtree"): "an earlier failed attempt's hidden copy",
        ("_put_back", "os.replace"): "the replaced run back in place, the failed attempt kept hidden for its logs",
    },
    # what a run writes for itself, in the run directory
    "lychee_exp/train/checkpoint.py": {
        ("_empty_tmp_dir", "shutil.rmtree"): "checkpoints/.tmp_step_N emptied before the ranks write into it",
        ("_empty_tmp_dir", ".mkdir"): "checkpoints/.tmp_step_N, a checkpoint's temporary directory",
        ("save_checkpoint", "safetensors.torch.save_file"): "a checkpoint's weights, into its temporary directory",
        ("save_checkpoint", "torch.save"): "a checkpoint's state.pt, into its temporary directory",
        ("save_checkpoint", "shutil.rmtree"): "the step's earlier checkpoint, and those beyond keep_checkpoints",
        ("save_checkpoint", "os.replace"): "the complete checkpoint renamed into place (`latest` then by io.atomic)",
        ("save_shards", ".save"): "every rank's DCP shards, into the checkpoint's temporary directory",
    },
    "lychee_exp/train/trainer.py": {
        ("train_on_rank", ".save"): "Trainer.save(metrics) (no path): model/ through save_reranker, listed below",
        ("Trainer._save_trained", ".save"): "Trainer.save before the final evaluation: model/ as train_on_rank's",
    },
    "lychee_exp/model/reranker.py": {
        ("_write_reranker", ".save_pretrained"): "model/'s files, into io.outputs.staged_directory's staging directory",
    },
    "lychee_exp/model/files.py": {
        ("write_card", ".write_text"): "model/'s card, into the same staging directory",
    },
    "lychee_exp/model/bi_encoder.py": {
        ("write_sentence_transformers_files", ".write_text"): "a bi-encoder's sentence-transformers files, same place",
        ("write_sentence_transformers_files", ".mkdir"): "their module directories, in the same staging directory",
    },
    "lychee_exp/tracking/backends.py": {
        ("WandbLogger.__init__", "wandb.init"): "the logger's own files: W&B's run files in <run>/wandb (rank 0)",
        ("WandbLogger.__init__", "shutil.rmtree"): "a failed online W&B attempt's local files, before going offline",
        ("TensorBoardLogger.__init__", "torch.utils.tensorboard.SummaryWriter"): (
            "the logger's own files: TensorBoard's event files in <run>/tensorboard (rank 0)"
        ),
        ("TensorBoardLogger.truncate", "torch.utils.tensorboard.SummaryWriter"): (
            "the same event files, reopened at a resumed run's step"
        ),
    },
    "lychee_exp/launch/launcher.py": {
        ("run_ranks", "torch.distributed.elastic.multiprocessing.DefaultLogsSpecs"): (
            "the logger's own files: per-rank logs in <output>/logs (a run's, or rerank's staging directory)"
        ),
        ("run_ranks", "shutil.rmtree"): "an earlier attempt's failure notes in <output>/logs/failures",
    },
    "lychee_exp/launch/failures.py": {
        ("note_failure", ".mkdir"): "<output>/logs/failures, where failing ranks leave their notes",
        ("note_failure", ".write_text"): "a failing rank's note (when and why), read by its launcher after it ended",
        ("note_failure", ".touch"): "an empty file whose name says that the rank's node was alive",
    },
    "lychee_exp/launch/rank_memory.py": {
        ("note_pid", ".mkdir"): "<output>/logs/failures, where a starting rank notes its pid",
        ("note_pid", ".write_text"): "a rank's pid, read by its launcher to watch the rank's peak memory",
    },
    "lychee_exp/launch/preemption.py": {
        ("request_stop", ".mkdir"): "<run>/logs, where a stop request is left",
        ("request_stop", ".write_text"): "a stop request, from a signal handler: its existence is the message",
        ("PreemptionWatch.__enter__", ".unlink"): "an earlier attempt's stop request",
        ("PreemptionWatch.hand_over", ".unlink"): "the stop request, answered",
    },
    "lychee_exp/launch/ranks.py": {
        ("_output_to", ".mkdir"): "<run>/logs/warm/<rank>, a warm rank's log directory",
        ("_output_to", "os.open"): "the logger's own files: a warm rank's log, appended while a trial runs",
        ("_configure_worker_logging", "logging.FileHandler"): "the logger's own files: rank 0 appends to Hydra's log",
    },
    # a sweep's directory (hydra.sweep.dir, checked by RunDirGuard.on_multirun_start) and its trials
    "lychee_exp/sweep/sweeper.py": {
        ("LycheeOptunaSweeperImpl._prepare", ".mkdir"): "the sweep directory, checked before the sweep started",
    },
    "lychee_exp/sweep/trials.py": {
        ("TrialRunner._claim", ".mkdir"): "a trial's run directory, claimed by mkdir: no two workers take one name",
    },
    "lychee_exp/tracking/trial.py": {
        ("open_storage", "optuna.storages.RDBStorage"): "a study's database (<sweep>/optuna.db or the user's URL)",
    },
    "lychee_exp/sweep/sweep_results.py": {
        ("_png", ".savefig"): "a plot into a bytes buffer, which io.atomic writes",
    },
    "hydra_plugins/lychee_submitit_launcher/launchers.py": {
        ("_WatchesJobs.launch", ".mkdir"): "the sweep directory, as upstream's launcher makes it (checked before)",
        ("_WatchesJobs._executor", "submitit.AutoExecutor"): "submitit's job files in its folder (<sweep>/.submitit)",
    },
    # the machine's cache (ir.cache, LYCHEE_CACHE_DIR): entries keyed by what decides them, written whole
    "lychee_exp/ir/cache.py": {
        ("cache_path", ".mkdir"): "the cache's directory for one kind of entry",
        ("computing", ".mkdir"): "that directory, for the lock of an entry a training step computes (io.lock)",
    },
    "lychee_exp/ir/first_stage.py": {
        ("_bm25", ".save"): "a BM25 index entry, into a pid-named temporary directory",
        ("_bm25", ".rename"): "that index renamed into place whole (the first writer wins)",
        ("_bm25", "shutil.rmtree"): "the temporary index of a writer that came second, or of a save stopped midway",
    },
    "lychee_exp/ir/dense.py": {
        ("_npy_bytes", "numpy.save"): "embeddings into a bytes buffer, which io.atomic writes",
    },
    "lychee_exp/ir/pipeline.py": {
        ("mine_to_file", ".mkdir"): "the mined file's directory: mine's staging directory, or a cache entry's",
    },
    # commands' outputs, written into the path io.outputs.staged_output yields
    "lychee_exp/tracking/report/html.py": {
        ("build", ".write_text"): "report's page, into staged_output's staging file",
        ("headless_chromium", "tempfile.TemporaryDirectory"): "a throwaway browser profile, gone when Chromium returns",
    },
    "lychee_exp/tracking/report/plots.py": {
        ("_svg", ".savefig"): "a report figure into a bytes buffer (inlined as SVG)",
    },
    "lychee_exp/tracking/wandb_workspace.py": {
        ("main.dashboard", ".write_text"): "dashboard --dry-run's definition, into staged_output's staging file",
    },
    # not a command's output
    "lychee_exp/launch/slurm_jobs.py": {
        ("check_slurm_accepts", "tempfile.NamedTemporaryFile"): "a script for `sbatch --test-only`, gone after it",
    },
    "lychee_exp/tracking/memory.py": {
        ("reset_peak_rss", ".write_text"): "/proc/self/clear_refs: a kernel control file, not a file on disk",
    },
}
WRITES = {(file, where, call): reason for file, listed in LISTED.items() for (where, call), reason in listed.items()}


# ------------------------------------------------------------------------------------------------ the detector
def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> qualified name of every import in a module (module level or in functions)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # `import torch.distributed` binds torch
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _qualified(node: ast.AST, imports: dict[str, str]) -> str | None:
    """`np.save` -> numpy.save when np is an import; None for a call on anything else (a Path, a model)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in imports:
        return ".".join([imports[node.id], *reversed(parts)])
    return None


def _writing_mode(mode: ast.AST | None) -> bool:
    """A mode that creates, truncates or appends; one that is not a literal counts (it cannot be told)."""
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True


def _argument(call: ast.Call, position: int, keyword: str) -> ast.AST | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def write_of(call: ast.Call, imports: dict[str, str]) -> str | None:
    """What a call writes as, or None: the qualified function (`shutil.rmtree`), `open`, `os.open`, or `.<method>`."""
    func = call.func
    name = _qualified(func, imports)
    if name in WRITE_CALLS:
        return name
    if name == "os.open":
        flags = _argument(call, 1, "flags")
        named = {getattr(n, "attr", getattr(n, "id", None)) for n in ast.walk(flags)} if flags else set()
        return "os.open" if named & WRITE_FLAGS else None
    if isinstance(func, ast.Name) and func.id == "open" and "open" not in imports:
        return "open" if _writing_mode(_argument(call, 1, "mode")) else None
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr == "open":  # a module's open(path, mode) or Path.open(mode)
        module = name is not None
        return ".open" if _writing_mode(_argument(call, 1 if module else 0, "mode")) else None
    if func.attr not in WRITE_METHODS:
        return None
    if func.attr in ("rename", "replace") and (name is not None or len(call.args) != 1 or call.keywords):
        return None
    if func.attr == "save" and not (call.args or call.keywords):
        return None
    return "." + func.attr


def writes_in(source: str) -> list[tuple[str, str, int]]:
    """(enclosing function, what it writes as, line) for every writing call in a module's source."""
    tree = ast.parse(source)
    imports = _imports(tree)
    found = []

    def visit(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*where, child.name]
            if isinstance(child, ast.Call) and (kind := write_of(child, imports)):
                found.append((".".join(where) or "<module>", kind, child.lineno))
            visit(child, inner)

    visit(tree, [])
    return found


def product_files(root: Path = ROOT) -> list[Path]:
    """Every module of the product outside io: the package and its Hydra plugins (not another project's)."""
    package = sorted((root / "lychee_exp").rglob("*.py"))
    plugins = sorted(p for d in (root / "hydra_plugins").glob("lychee_*") for p in d.rglob("*.py"))
    return [p for p in package + plugins if (root / "lychee_exp" / "io") not in p.parents]


def sites(root: Path = ROOT) -> dict[tuple[str, str, str], list[int]]:
    """(file, function, call) -> its lines, for every write outside io."""
    found: dict[tuple[str, str, str], list[int]] = {}
    for path in product_files(root):
        for where, kind, line in writes_in(path.read_text()):
            found.setdefault((path.relative_to(root).as_posix(), where, kind), []).append(line)
    return found


def unlisted_and_stale(root: Path = ROOT) -> tuple[list[str], list[str]]:
    found = sites(root)
    unlisted = [
        f"{f}:{lines[0]} {where}: {kind}"
        for (f, where, kind), lines in sorted(found.items())
        if (f, where, kind) not in WRITES
    ]
    stale = [f"{f} {where}: {kind}" for f, where, kind in sorted(WRITES) if (f, where, kind) not in found]
    return unlisted, stale


# ------------------------------------------------------------------------------------------------ the tests
def test_every_write_outside_io_is_listed_with_its_reason():
    unlisted, _ = unlisted_and_stale()
    assert not unlisted, (
        "writes outside lychee_exp/io: route a command's output through io.atomic / io.outputs, or list the site "
        "in LISTED with its reason:\n" + "\n".join(unlisted)
    )


def test_no_listed_write_is_gone():
    _, stale = unlisted_and_stale()
    assert not stale, "listed in LISTED but no longer in the source (remove or re-key them):\n" + "\n".join(stale)


def test_every_reason_is_one_line():
    for site, reason in WRITES.items():
        assert reason.strip() and "\n" not in reason and len(reason) < 120, site


def test_the_detector_sees_the_package():
    found = sites()
    files = {f for f, _, _ in found}
    assert any(f.startswith("hydra_plugins/lychee_submitit_launcher/") for f in files)
    assert not any(f.startswith("lychee_exp/io/") for f in files)
    assert ("lychee_exp/train/checkpoint.py", "save_checkpoint", "torch.save") in found


BYPASSES = """
import json, os, shutil, tempfile, pickle
import numpy as np
import torch
from pathlib import Path
from safetensors.torch import save_file
from os import replace as swap

def leak(out, model, cfg, handle, figure):
    open(out, "w")
    open(out, mode="a")
    Path(out).open("wb")
    os.open(out, os.O_WRONLY | os.O_CREAT)
    Path(out).write_text("x")
    Path(out).write_bytes(b"x")
    Path(out).touch()
    Path(out).mkdir()
    os.makedirs(out)
    out.unlink()
    out.rename(out.with_suffix(".old"))
    out.replace(out.with_suffix(".old"))
    swap(out, out)
    shutil.rmtree(out)
    shutil.copy2(out, out)
    tempfile.mkdtemp()
    torch.save({}, out)
    save_file({}, out)
    np.save(out, [])
    json.dump({}, handle)
    pickle.dump({}, handle)
    model.save_pretrained(out)
    cfg.save(out)
    figure.savefig(out)
"""

HARMLESS = """
import dataclasses, json, os
from pathlib import Path

def read(path, cfg, text, space):
    open(path)
    open(path, "rb")
    Path(path).open()
    Path(path).open("r", encoding="utf-8")
    os.open(path, os.O_RDONLY)
    Path(path).read_text()
    text.replace("a", "b")
    dataclasses.replace(cfg, seed=1)
    json.dumps({})
    space.save()
    os.path.join(path, "x")
"""


def test_the_detector_flags_each_kind_of_write_and_nothing_that_only_reads():
    found = [kind for where, kind, _ in writes_in(BYPASSES)]
    assert found == [
        "open",
        "open",
        ".open",
        "os.open",
        ".write_text",
        ".write_bytes",
        ".touch",
        ".mkdir",
        "os.makedirs",
        ".unlink",
        ".rename",
        ".replace",
        "os.replace",  # imported under another name
        "shutil.rmtree",
        "shutil.copy2",
        "tempfile.mkdtemp",
        "torch.save",
        "safetensors.torch.save_file",
        "numpy.save",
        "json.dump",
        "pickle.dump",
        ".save_pretrained",
        ".save",
        ".savefig",
    ]
    assert {where for where, _, _ in writes_in(BYPASSES)} == {"leak"}
    assert writes_in(HARMLESS) == []


def test_a_planted_bypass_and_a_removed_site_fail(tmp_path):
    """A copy of the product with one more module that writes a command's output itself, and one listed site
    gone: the first is unlisted, the second stale."""
    shutil.copytree(PACKAGE, tmp_path / "lychee_exp", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copytree(ROOT / "hydra_plugins", tmp_path / "hydra_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "lychee_exp" / "ir" / "leak.py").write_text(
        "from pathlib import Path\n\n\nclass Mined:\n    def dump(self, out):\n        Path(out).write_text('x')\n"
    )
    memory = tmp_path / "lychee_exp" / "tracking" / "memory.py"
    memory.write_text(memory.read_text().replace('Path("/proc/self/clear_refs").write_text("5")', "pass"))
    unlisted, stale = unlisted_and_stale(tmp_path)
    assert unlisted == ["lychee_exp/ir/leak.py:6 Mined.dump: .write_text"]
    assert stale == ["lychee_exp/tracking/memory.py reset_peak_rss: .write_text"]


def test_every_name_a_run_writes_at_its_top_is_one_the_policy_knows():
    """overwrite=true replaces a run holding only RUN_NAMES: a name a run writes itself and the policy does not
    know (metrics.csv was one) would make every such run irreplaceable. The names, from the writers' own
    constants and paths."""
    from lychee_exp.job.results import write_results  # noqa: F401  (metrics.json: its literal below)
    from lychee_exp.launch.failures import FAILURE_NOTES
    from lychee_exp.launch.preemption import REQUEST_FILE
    from lychee_exp.launch.ranks import WARM_LOGS
    from lychee_exp.tracking.backends import CSVLogger
    from lychee_exp.train.checkpoint import CHECKPOINT_DIR

    top = {Path(p).parts[0] for p in (FAILURE_NOTES, REQUEST_FILE, WARM_LOGS)}
    top |= {CSVLogger(Path("run")).path.name, CHECKPOINT_DIR, RUN_MARKER, "metrics.json", "config.yaml", "model"}
    top |= {"wandb", "tensorboard", "logs", ".hydra"}
    assert top <= RUN_NAMES, top - RUN_NAMES
