"""Hostile configs, model directories and data (issue 51 B): what used to end in a traceback, or train and score
silently wrong, and is now one line (exit 2, naming the key or the file and line, before any rank starts), or
done without losing anything.

- the typed schema's bounds: optimizer.betas (two values in [0, 1)), seed (what numpy seeds: 0 .. 2**32 - 1),
  model.dropout and model.lora.dropout in [0, 1), trainer.max_steps (-1 or >= 1), for run, plan, rerank and mine;
- a bare `=5` override;
- a model directory whose config.json no longer fits its weights (a changed hidden_size), a tokenizer.json of
  `{}` (or a tokenizer transformers cannot build), a directory without weights: training refuses them in its
  preflight (rerank and mine: tests/test_hostile_inputs.py, whose damage table holds the same cases);
- an untrained preset (model=tiny_lychee) is scored by rerank / mine teacher=reranker only when asked for
  (model.random_init=true), and trains from random weights only as its own preset, never under a model.path;
- NaN or infinite teacher scores in a data file, named by file and line;
- a saved model (and a checkpoint) gets the umask's permissions on every file, and is written whole: a full disk
  while saving is one line (exit 1) and leaves no model/ without weights, an earlier model/ as it was.

For each guard, what wrong code would still pass its test is said beside it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from beir_helpers import fruit_dataset
from conftest import TINY_OVERRIDES, compose_config, output_lines, run_cli
from test_model import tiny_reranker
from test_user_files import _no_temporaries, _run

from lychee_exp.config.schema import to_run_config
from lychee_exp.data.queries import load_queries
from lychee_exp.errors import RunFailed, UserError
from lychee_exp.io.lock import short_name
from lychee_exp.job.training_job import with_model_resolved
from lychee_exp.mine import main as mine_main
from lychee_exp.model.reranker import load_tokenizer, save_reranker
from lychee_exp.plan import main as plan_main
from lychee_exp.rerank import main as rerank_main
from lychee_exp.train.checkpoint import save_checkpoint
from lychee_exp.train.inputs import load_inputs

UNTRAINED = "holds no weights (tiny_lychee is untrained)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A tiny Lychee model as save_reranker writes it, and what it was saved from (to save it again)."""
    tmp = tmp_path_factory.mktemp("hostile_config")
    cfg, tokenizer, _, reranker = tiny_reranker(tmp)
    save_reranker(reranker, tokenizer, cfg, tmp / "model")
    return {"dir": tmp / "model", "cfg": cfg, "tokenizer": tokenizer, "reranker": reranker}


def _wider_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] + 32}))


def _empty_tokenizer_json(model: Path) -> None:
    (model / "tokenizer.json").write_text("{}")


def _no_weights(model: Path) -> None:
    for weights in model.glob("*.safetensors"):
        weights.unlink()


# ------------------------------------------------------------------------------------------------ config bounds
BOUNDS = {
    "optimizer.betas=[0.9]": "optimizer.betas must hold 2 values, got [0.9]",
    "optimizer.betas=[0.9,0.99,0.9]": "optimizer.betas must hold 2 values, got [0.9, 0.99, 0.9]",
    "optimizer.betas=[0.9,1.5]": "optimizer.betas[1] must be < 1, got 1.5",
    "optimizer.betas=[0.9,1.0]": "optimizer.betas[1] must be < 1, got 1.0",
    "optimizer.betas=[-0.1,0.9]": "optimizer.betas[0] must be >= 0, got -0.1",
    "optimizer.eps=-1e-8": "optimizer.eps must be >= 0, got -1e-08",
    "seed=-1": "seed must be >= 0, got -1",
    "seed=4294967296": "seed must be <= 4294967295, got 4294967296",
    "model.dropout=1.5": "model.dropout must be < 1, got 1.5",
    "model.dropout=-0.1": "model.dropout must be >= 0, got -0.1",
    "model.lora.dropout=1.0": "model.lora.dropout must be < 1, got 1.0",
    "trainer.max_steps=0": "trainer.max_steps must be -1 (train max_epochs) or >= 1, got 0",
    "trainer.max_steps=-2": "trainer.max_steps must be -1 (train max_epochs) or >= 1, got -2",
}


@pytest.mark.parametrize("override", BOUNDS)
def test_a_value_out_of_range_names_the_key(tmp_path, override):
    """Each used to reach torch (AdamW, numpy's seeding, nn.Dropout) inside a rank, or (max_steps=0) to train an
    epoch. Wrong code that would still pass: bounds on the betas' length only (the range cases), or on each
    beta only (the length cases)."""
    with pytest.raises(UserError) as refused:
        to_run_config(compose_config([*TINY_OVERRIDES, override], tmp_path))
    assert str(refused.value) == BOUNDS[override]


@pytest.mark.parametrize(
    "override",
    ["seed=0", "seed=4294967295", "optimizer.betas=[0.0,0.999]", "model.dropout=0.0", "trainer.max_steps=-1"],
)
def test_the_edges_of_each_range_are_accepted(tmp_path, override):
    """Wrong code that would still pass the refusals above: bounds one step too tight (seed <= 2**31, beta > 0)."""
    to_run_config(compose_config([*TINY_OVERRIDES, override], tmp_path))


@pytest.mark.parametrize(
    ("which", "override", "expected"),
    [
        ("plan", "optimizer.betas=[0.9]", BOUNDS["optimizer.betas=[0.9]"]),
        ("plan", "trainer.max_steps=0", BOUNDS["trainer.max_steps=0"]),
        ("rerank", "seed=-1", "seed must be >= 0, got -1"),
        ("rerank", "model.dropout=1.5", BOUNDS["model.dropout=1.5"]),
        ("mine", "seed=4294967296", "seed must be <= 4294967295, got 4294967296"),
    ],
)
def test_plan_rerank_and_mine_refuse_the_same_values(tmp_path, ir_cache, capsys, caplog, which, override, expected):
    """The commands that share the schema (plan: the run's; rerank, mine: the model's, and their own seed).
    Wrong code that would still pass: bounds on RunConfig.seed alone (rerank's and mine's seeds are their own)."""
    if which == "plan":
        with pytest.raises(SystemExit) as ended:
            plan_main([override, "parallel=single"])
        code, lines = ended.value.code, capsys.readouterr().err.splitlines()
    else:
        root = fruit_dataset(tmp_path / "fruit")
        code, lines = _run(which, [f"dataset={root}", f"out={tmp_path / 'out'}", override], capsys, caplog)
    assert code == 2 and len(lines) == 1 and lines[0] == f"error: {expected}", lines
    assert not (tmp_path / "out").exists()


def test_a_bad_value_is_one_line_from_the_cli_before_any_rank(tmp_path):
    """The run's own exit code and line (the rest of the table in-process above). Before: an IndexError from
    AdamW in a rank, exit 1."""
    proc = run_cli([*_ranks(TINY_OVERRIDES), "optimizer.betas=[0.9]"], tmp_path / "run")
    errors = [line for line in output_lines(proc) if "error" in line.lower() or "Traceback" in line]
    assert proc.returncode == 2 and len(errors) == 1, output_lines(proc)
    assert errors[0].endswith(f"error: {BOUNDS['optimizer.betas=[0.9]']}")
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


# ---------------------------------------------------------------------------------------------- a keyless override
def test_a_keyless_override_is_one_line_for_the_run(tmp_path):
    """Before: Hydra's ValueError "Config group override must be a string or a list. Got int", a traceback."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.run(
        [sys.executable, "-m", "lychee_exp.run", "=5", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == ["error: =5: an override is key=value, and this one has no key"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("which", ["rerank", "mine", "plan"])
@pytest.mark.parametrize("override", ["=5", "+=abc"])
def test_a_keyless_override_is_one_line_for_every_command(tmp_path, capsys, caplog, which, override):
    """`+=abc` used to be answered with Hydra's advice to write `+=abc`, the very override given. Wrong code that
    would still pass `=5`: a check of the first character only."""
    if which == "plan":
        with pytest.raises(SystemExit) as ended:
            plan_main([override])
        code, lines = ended.value.code, capsys.readouterr().err.splitlines()
    else:
        code, lines = _run(which, [override, f"out={tmp_path / 'out'}"], capsys, caplog)
    assert code == 2 and lines == [f"error: {override}: an override is key=value, and this one has no key"], lines


# ----------------------------------------------------------------------------------------- model directories
MODEL_DAMAGE = {
    # transformers' size-mismatch RuntimeError from inside loading, in a rank
    "hidden-size": (_wider_config, "{path}/model.safetensors does not fit {path}/config.json (", "hidden_size=96"),
    # KeyError: 'added_tokens' from AutoTokenizer
    "tokenizer-json": (_empty_tokenizer_json, "{path}/tokenizer.json is not a tokenizer (", "Model missing"),
    # trained from random weights under model=tiny_lychee, without a word
    "no-weights": (_no_weights, "no weights in {path} (no *.safetensors or *.bin)", "model.random_init=true"),
}


def _ranks(overrides: list[str]) -> list[str]:
    """The tiny run on two DDP ranks: a refusal must come before they start (they would write <run>/logs)."""
    kept = [o for o in overrides if not o.startswith(("parallel=", "gpus="))]
    return [*kept, "parallel=ddp", "gpus=2"]


@pytest.mark.parametrize("damage", MODEL_DAMAGE)
def test_training_refuses_a_damaged_model_directory_before_any_rank(saved, tmp_path, damage):
    """One line naming the file, exit 2, in the Hydra process (no rank logs). Wrong code that would still pass:
    the no-weights refusal only when the preset has random_init false (the run here says model=tiny_lychee)."""
    damage_it, expected, detail = MODEL_DAMAGE[damage]
    model = shutil.copytree(saved["dir"], tmp_path / "model")
    damage_it(model)
    proc = run_cli([*_ranks(TINY_OVERRIDES), f"model.path={model}"], tmp_path / "run")
    errors = [line for line in output_lines(proc) if "error" in line.lower() or "Traceback" in line]
    assert proc.returncode == 2 and len(errors) == 1, output_lines(proc)
    assert f"error: model.path={model}: " + expected.format(path=model) in errors[0] and detail in errors[0], errors
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "model").exists()


def test_a_tokenizer_transformers_cannot_build_is_one_line(saved, tmp_path):
    """Files the tokenizers library is not asked about (tokenizer_config.json) still end in one line naming the
    directory. Before: AttributeError from inside AutoTokenizer."""
    model = shutil.copytree(saved["dir"], tmp_path / "model")
    (model / "tokenizer_config.json").write_text("[1]")
    cfg = dataclasses.replace(saved["cfg"], path=str(model))
    with pytest.raises(UserError, match=f"^model.path={model}: transformers cannot build a tokenizer from {model} "):
        load_tokenizer(cfg)


def _inputs(tmp_path: Path, *overrides: str):
    """What training's preflight reads, for a config as the run resolves it (model.path's weights, or not)."""
    cfg = compose_config([*TINY_OVERRIDES, *overrides], tmp_path / "run")
    return load_inputs(to_run_config(with_model_resolved(cfg)))


def test_random_weights_for_a_model_path_only_when_asked(saved, tmp_path):
    """The preset's random_init stays its own: model=tiny_lychee alone trains from random weights, as do
    model.path=<a directory without weights> and model.random_init=true; the directory alone is refused.
    Wrong code that would still pass the refusal: refusing random_init with every model.path."""
    model = shutil.copytree(saved["dir"], tmp_path / "model")
    _no_weights(model)
    _inputs(tmp_path)  # the preset alone
    _inputs(tmp_path, f"model.path={model}", "model.random_init=true")
    with pytest.raises(UserError, match="model.random_init=true to initialise this architecture from scratch"):
        _inputs(tmp_path, f"model.path={model}")


# ------------------------------------------------------------------------------------------ scoring untrained
@pytest.mark.parametrize("which", ["rerank", "mine"])
def test_scoring_an_untrained_preset_is_refused_unless_asked(tmp_path, ir_cache, capsys, caplog, which):
    """Before: rerank model=tiny_lychee wrote run.trec and metrics.json from random weights, exit 0. Wrong code that
    would still pass: refusing model.random_init=true too (the second command must run)."""
    root = fruit_dataset(tmp_path / "fruit")
    args = [f"dataset={root}", "model=tiny_lychee", "progress_bar=false"]
    if which == "rerank":
        args += ["split=test", "top_k=4"]
    else:
        args += ["split=train", "teacher=reranker", "range_min=1", "range_max=10", "num_negatives=3"]
    out = tmp_path / ("out" if which == "rerank" else "out.jsonl")
    code, lines = _run(which, [*args, f"out={out}"], capsys, caplog)
    assert code == 2 and len(lines) == 1, lines
    assert f"error: model.path=pkg://lychee_exp.assets/tiny_qwen2 {UNTRAINED}" in lines[0], lines
    assert "model.path=<run>/model" in lines[0] and not out.exists() and _no_temporaries(tmp_path)
    (rerank_main if which == "rerank" else mine_main)([*args, f"out={out}", "model.random_init=true"])  # no exit
    assert out.exists()


# --------------------------------------------------------------------------------------------- teacher scores
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("key", ["pos_scores", "neg_scores"])
def test_a_teacher_score_that_is_not_finite_names_file_and_line(tmp_path, key, value):
    """json reads NaN and Infinity: a NaN turned distillation off (train_distill_loss 0.0) and the teacher's dev
    figure into NaN. Wrong code that would still pass: a check of NaN alone (x != x), or of pos_scores alone."""
    good = {"query": "q", "pos": ["p"], "neg": ["n1", "n2"], "pos_scores": [2.0], "neg_scores": [1.0, 0.5]}
    bad = {**good, key: [float(value)] * len(good[key])}
    file = tmp_path / "train.jsonl"
    file.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(UserError) as refused:
        load_queries(str(file), "data.train_file")
    assert str(refused.value) == f"{file}:2: '{key}' must hold finite numbers, got {value}"


# -------------------------------------------------------------------------------------------- saved models
@pytest.fixture
def umask_027():
    """A umask that keeps group read and drops others: neither safetensors' 0600 nor the usual 0644."""
    previous = os.umask(0o027)
    yield 0o640
    os.umask(previous)


def _modes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mode & 0o777 for p in directory.rglob("*") if p.is_file()}


def test_a_saved_model_has_the_umasks_permissions(saved, tmp_path, umask_027):
    """Every file of model/ as a file written under the same umask gets it (safetensors wrote 0600). Wrong code
    that would still pass: a chmod to a fixed 0644 (the umask here gives 0640)."""
    probe = tmp_path / "probe"
    probe.write_text("written by the user")
    save_reranker(saved["reranker"], saved["tokenizer"], saved["cfg"], tmp_path / "model")
    modes, written = _modes(tmp_path / "model"), probe.stat().st_mode & 0o777
    assert written == umask_027 and "model.safetensors" in modes and set(modes.values()) == {written}, modes
    assert (tmp_path / "model").stat().st_mode & 0o777 == 0o750


def test_a_checkpoint_has_the_umasks_permissions(tmp_path, umask_027):
    layer = torch.nn.Linear(2, 2)
    checkpoint = save_checkpoint(tmp_path, 3, layer, {"step": torch.tensor(3)}, keep=1)
    assert _modes(checkpoint) == {"model.safetensors": umask_027, "state.pt": umask_027}


def _earlier_model(model: Path) -> dict[str, bytes]:
    """A resumed run's earlier model/ (small enough to fit where the new one does not)."""
    model.mkdir()
    (model / "config.json").write_text('{"earlier": true}\n')
    (model / "model.safetensors").write_bytes(b"earlier weights")
    return {p.name: p.read_bytes() for p in model.iterdir()}


def test_saving_replaces_an_earlier_model_whole(saved, tmp_path):
    """Wrong code that would still pass: saving into model/ in place (the earlier file that the new model does not
    write would stay beside it)."""
    _earlier_model(tmp_path / "model")
    (tmp_path / "model" / "only_in_the_earlier.txt").write_text("old")
    save_reranker(saved["reranker"], saved["tokenizer"], saved["cfg"], tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(p.name for p in saved["dir"].iterdir())
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == (saved["dir"] / "model.safetensors").read_bytes()
    assert _no_temporaries(tmp_path)


def test_a_save_killed_earlier_leaves_nothing_behind_the_next(saved, tmp_path):
    """A run SIGKILLed while saving leaves its hidden directory (named for its pid) beside model/: the next save
    removes it. Wrong code that would still pass the tests above: staging beside model/ without ever cleaning up."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".{short_name(tmp_path / 'model')}.tmp-{dead.stdout.strip()}-0badcafe"  # io.outputs' name
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    save_reranker(saved["reranker"], saved["tokenizer"], saved["cfg"], tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("earlier", [False, True], ids=["first-save", "resumed-run"])
def test_a_full_disk_while_saving_leaves_no_model_without_weights(saved, small_disk, earlier):
    """A real ENOSPC (a tmpfs smaller than the weights): before, model/ held config.json and no weights, and the
    run ended in safetensors' traceback. Wrong code that would still pass: an earlier model/ deleted before the
    new one is complete (the resumed case), or the hidden staging directory left behind."""
    disk = small_disk(600)
    before = _earlier_model(disk / "model") if earlier else None
    with pytest.raises(RunFailed) as failed:
        save_reranker(saved["reranker"], saved["tokenizer"], saved["cfg"], disk / "model")
    assert "no space left on device" in str(failed.value).lower() and f"saving the model to {disk / 'model'}" in str(
        failed.value
    )
    if earlier:
        assert {p.name: p.read_bytes() for p in (disk / "model").iterdir()} == before
    else:
        assert not (disk / "model").exists()
    assert [p.name for p in disk.iterdir()] == (["model"] if earlier else [])  # no staging directory left


def test_a_full_disk_while_a_run_saves_is_one_line(small_disk):
    """The run's end: exit 1, one error line, no model/ (it would hold config.json without weights)."""
    disk = small_disk(700)  # the run's logs and config fit, the 1.3 MB of weights do not
    proc = run_cli(TINY_OVERRIDES, disk / "run")
    errors = [line for line in output_lines(proc) if "error" in line.lower() or "Traceback" in line]
    assert proc.returncode == 1 and len(errors) == 1, output_lines(proc)
    assert f"error: saving the model to {disk / 'run' / 'model'} failed: " in errors[0], errors
    assert "no space left on device" in errors[0].lower()
    # the checkpoints before it (on by default) failed first: each a warning, and the run went on to its end
    said = output_lines(proc)
    assert any("checkpoint of step" in line and "not written: No space left on device" in line for line in said)
    assert not (disk / "run" / "model").exists() and not [p for p in (disk / "run").iterdir() if ".tmp-" in p.name]
