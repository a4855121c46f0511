"""Hostile inputs (issue 39 B): what a user can hand mine, rerank, plan and report that used to end in a traceback
or silently wrong results. Each case: exit code 2, one line naming the key, file or value, every user file left
byte for byte, nothing half-written. (Sweeps: tests/test_sweeper_conformance.py, another search space.)

For each guard, what wrong code would still pass its test is said beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from beir_helpers import fruit_dataset
from conftest import TINY_OVERRIDES, output_lines, run_cli
from test_model import tiny_reranker
from test_user_files import _command, _no_temporaries, _run, _user_files

from lychee_exp.config.auto import parse_gpus
from lychee_exp.errors import UserError
from lychee_exp.model.files import CARD_FILE
from lychee_exp.model.reranker import save_reranker
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.plan import main as plan_main
from lychee_exp.tracking.report.html import main as report_main
from lychee_exp.tracking.report.output import GENERATOR_TAG


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A tiny Lychee run's model/ as save_reranker writes it (weights, tokenizer, card)."""
    tmp = tmp_path_factory.mktemp("hostile_model")
    cfg, tokenizer, _, reranker = tiny_reranker(tmp)
    save_reranker(reranker, tokenizer, cfg, tmp / "model")
    return tmp / "model"


def _not_json(model: Path) -> None:
    (model / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"],\n')


def _truncated(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])  # the header is whole, the tensors are cut


def _missing_shard(model: Path) -> None:
    weight_map = {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _no_tokenizer(model: Path) -> None:
    for path in model.glob("tokenizer*"):
        path.unlink()


def _wider_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] + 32}))


def _empty_tokenizer_json(model: Path) -> None:
    (model / "tokenizer.json").write_text("{}")


def _later_card(model: Path) -> None:
    card = json.loads((model / CARD_FILE).read_text())
    (model / CARD_FILE).write_text(json.dumps({**card, "format_version": 7}))


DAMAGE = {
    "config-not-json": (_not_json, "{key}={path}: {path}/config.json is not readable JSON ("),
    "truncated-weights": (_truncated, "{key}={path}: {path}/model.safetensors is truncated (100,000 of "),
    "missing-shard": (
        _missing_shard,
        "{key}={path}: {path}/model.safetensors.index.json names 1 missing shard(s) (model-00002-of-00002.safetensors)",
    ),
    "no-tokenizer": (_no_tokenizer, "{key}={path}: {path} has no tokenizer files (none of tokenizer.json, "),
    # issue 51: transformers' size-mismatch RuntimeError from inside loading; AutoTokenizer's KeyError 'added_tokens'
    "config-hidden-size": (
        _wider_config,
        "{key}={path}: {path}/model.safetensors does not fit {path}/config.json (model.embed_tokens.weight is "
        "[4097, 64] in the weights, [4097, 96] by config.json's hidden_size=96)",
    ),
    "tokenizer-json-empty": (
        _empty_tokenizer_json,
        "{key}={path}: {path}/tokenizer.json is not a tokenizer (Model missing. at line 1 column 2)",
    ),
    "card-format-version": (
        _later_card,
        "model.path: {path}/lychee_reranker.json has format_version=7; this lychee_exp reads format_version 1 ",
    ),
}
USES = {  # (command, the key naming the model directory, extra arguments)
    "rerank": ("rerank", "model.path", []),
    "mine-reranker-teacher": ("mine", "model.path", ["teacher=reranker"]),
    "mine-dense-teacher": ("mine", "dense.model", ["teacher=dense"]),
}


@pytest.mark.parametrize("use", USES)
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_model_directory_is_one_line(saved_model, tmp_path, ir_cache, capsys, caplog, damage, use):
    """Each damaged file is checked before transformers reads it (model.files, model.files.read_card).
    Wrong code that would still pass: a check of the first weights file only (the fixture has one); a tokenizer
    check that accepts tokenizer_config.json alone (the fixture removes every tokenizer* file)."""
    which, key, extra = USES[use]
    if key == "dense.model" and damage == "card-format-version":
        pytest.skip("a bi-encoder directory has no card")
    damage_it, expected = DAMAGE[damage]
    model = shutil.copytree(saved_model, tmp_path / "model")
    damage_it(model)
    root = fruit_dataset(tmp_path / "fruit")
    before = _user_files(tmp_path)
    code, lines = _run(which, _command(which, root, tmp_path / "out", f"{key}={model}", *extra), capsys, caplog)
    assert code == 2 and len(lines) == 1, lines
    assert expected.format(key=key, path=model) in lines[0], lines
    assert _user_files(tmp_path) == before and not (tmp_path / "out").exists() and _no_temporaries(tmp_path)


def test_training_from_truncated_weights_is_one_line_before_any_rank(saved_model, tmp_path):
    """The same check in the run's preflight (train.inputs): without it a rank failed with the weights' error, a
    torch warning and exit 1. Wrong code that would still pass: a preflight that checks only model.safetensors,
    not other shards (the fixture has the one file)."""
    model = shutil.copytree(saved_model, tmp_path / "model")
    _truncated(model)
    proc = run_cli([*TINY_OVERRIDES, f"model.path={model}", "logger=none"], tmp_path / "run")
    errors = [line for line in output_lines(proc) if "ERROR" in line or "Traceback" in line or line.startswith("W")]
    assert proc.returncode == 2 and len(errors) == 1, output_lines(proc)
    assert "error: " + DAMAGE["truncated-weights"][1].format(key="model.path", path=model) in errors[0], errors
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.parametrize("damage", ["config-not-json", "no-tokenizer", "tokenizer-json-empty", "card-format-version"])
def test_plan_names_a_damaged_model_directory(saved_model, tmp_path, capsys, damage):
    """plan reads config.json, the tokenizer (the prompt's width) and the card; it never reads the weights, so a
    truncated weights file is no reason to refuse a plan. Wrong code that would still pass: a plan that checks
    the weights too."""
    damage_it, expected = DAMAGE[damage]
    model = shutil.copytree(saved_model, tmp_path / "model")
    damage_it(model)
    with pytest.raises(SystemExit) as ended:
        plan_main([f"model.path={model}", "parallel=single"])
    out, err = capsys.readouterr()
    assert ended.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert expected.format(key="model.path", path=model) in err, err


@pytest.mark.parametrize("which", ["rerank", "mine"])
def test_random_init_with_a_trained_model_path_is_refused(saved_model, tmp_path, ir_cache, capsys, caplog, which):
    """It would score a random model under the trained directory's name. Wrong code that would still pass: a
    refusal of random_init whenever model.path is given, even without weights (the tiny_lychee preset's own
    directory has none; tests/test_user_files.py runs it)."""
    root = fruit_dataset(tmp_path / "fruit")
    extra = ["teacher=reranker"] if which == "mine" else []
    args = _command(which, root, tmp_path / "out", f"model.path={saved_model}", "model.random_init=true", *extra)
    code, lines = _run(which, args, capsys, caplog)
    assert code == 2 and len(lines) == 1, lines
    assert f"model.random_init=true with model.path={saved_model}, which holds trained weights" in lines[0]
    assert not (tmp_path / "out").exists() and _no_temporaries(tmp_path)


@pytest.mark.parametrize("which", ["rerank", "mine"])
def test_a_split_whose_qrels_path_is_a_directory_is_one_line(tmp_path, ir_cache, capsys, caplog, which):
    """rerank took it for a split without qrels and wrote unjudged results; mine listed it among the splits.
    Wrong code that would still pass: an is_dir() check only (a qrels path that is a fifo or a device would pass
    it; not tried)."""
    root = fruit_dataset(tmp_path / "fruit")
    (root / "qrels" / "dev.tsv").mkdir()
    before = _user_files(tmp_path)
    code, lines = _run(which, _command(which, root, tmp_path / "out", "split=dev"), capsys, caplog)
    assert code == 2 and len(lines) == 1, lines
    assert f"split=dev: {root / 'qrels' / 'dev.tsv'} is a directory, not a qrels file" in lines[0], lines
    assert _user_files(tmp_path) == before and not (tmp_path / "out").exists()


def _refusal(call) -> str:
    with pytest.raises(UserError) as refused:
        call()
    return f"error: {refused.value}\n"


@pytest.mark.parametrize(
    ("args", "cuda", "run_says"),
    [
        (["gpus=0"], 0, lambda: parse_gpus(0)),
        (["gpus=-2"], 0, lambda: parse_gpus(-2)),
        (["parallel=single", "gpus=2"], 0, lambda: plan_devices("single", 2, cuda_count=0)),
        (["parallel=ddp", "gpus=4"], 2, lambda: plan_devices("ddp", 4, cuda_count=2)),
    ],
    ids=["zero", "negative", "single-with-two", "more-than-visible"],
)
def test_plan_refuses_gpus_as_the_run_does(monkeypatch, capsys, args, cuda, run_says):
    """The line is the one parallel.devices gives the run (parse_gpus through check_config, plan_devices).
    more-than-visible pretends 2 CUDA GPUs; without CUDA, plan sizes a machine with the GPUs asked for. Wrong code
    that would still pass: a plan that refuses any count above the visible GPUs on a machine without CUDA too
    (test_plan.py's fsdp gpus=8 plan catches that)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    with pytest.raises(SystemExit) as ended:
        plan_main(args)
    out, err = capsys.readouterr()
    assert ended.value.code == 2 and out == "" and err == _refusal(run_says), err


# ------------------------------------------------------------------------------------------------------- report
@pytest.fixture
def runs(tmp_path) -> Path:
    """Two runs: one readable, one whose metrics.json is not JSON."""
    for name, metrics in (("good", '{"ndcg@10": 0.61}\n'), ("broken", '{"ndcg@10": 0.6\n')):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.json").write_text(metrics)
        (tmp_path / "runs" / name / "config.yaml").write_text("seed: 1\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.jsonl").write_text('{"_id": "d1", "text": "the user\'s"}\n')
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "summary.txt").write_text("what the user wrote\n")
    return tmp_path / "runs"


def _report(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    code = report_main([*args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        (lambda t: t / "runs" / "good" / "metrics.json", "would replace {t}/runs/good/metrics.json, an input of this"),
        (lambda t: t / "runs" / "good" / "config.yaml", "config.yaml, read by the report"),
        (lambda t: t / "data", "is a directory; this command writes a file"),
        (lambda t: t / "runs", "holds {t}/runs/"),
        (lambda t: t / "notes" / "summary.txt", "summary.txt already holds results (summary.txt): set --overwrite"),
        (lambda t: t / "data" / "corpus.jsonl", "corpus.jsonl is inside {t}/data, a dataset: write elsewhere"),
    ],
    ids=["metrics-json", "config-yaml", "a-directory", "the-runs-directory", "a-foreign-file", "a-dataset-file"],
)
def test_report_out_never_replaces_the_users_files(runs, tmp_path, capsys, out, expected):
    """Wrong code that would still pass: protecting metrics.json and config.yaml only, not metrics.csv,
    trials.csv, optimization_results.yaml or bench.csv (only the first two are tried)."""
    target = out(tmp_path)
    before = _user_files(tmp_path)
    code, printed, errors = _report(capsys, str(runs), "--out", str(target))
    refusals = [line for line in errors if line.startswith("error: ")]
    assert code == 2 and printed == [] and len(refusals) == 1, errors
    assert refusals[0].startswith(f"error: --out={target}") and expected.format(t=tmp_path) in refusals[0], errors
    assert _user_files(tmp_path) == before and _no_temporaries(tmp_path)


def test_report_replaces_its_own_page_and_a_foreign_file_only_with_overwrite(runs, tmp_path, capsys, caplog):
    """Re-running the report refreshes its page without a flag (the generator tag marks it); a foreign file needs
    --overwrite. The unreadable run is skipped with one warning naming its file; the other run is reported.
    Wrong code that would still pass: a marker check that accepts any HTML page (not tested: a user's own page
    with the very same tag would be replaced)."""
    code, printed, errors = _report(capsys, str(runs))
    page = runs / "report.html"
    assert code == 0 and printed == [str(page)] and GENERATOR_TAG in page.read_text()
    # one warning (on stderr from the command, through logging's last resort; pytest's handler holds it here)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        f"skipping {runs / 'broken' / 'metrics.json'}: Expecting ',' delimiter: line 2 column 1 (char 16)"
    ]
    assert ">good<" in page.read_text() and ">broken<" not in page.read_text()
    page.write_text(page.read_text().replace("good", "stale"))
    assert _report(capsys, str(runs))[0] == 0 and "stale" not in page.read_text()  # its own page: replaced
    corpus = tmp_path / "data" / "corpus.jsonl"
    assert _report(capsys, str(runs), "--out", str(corpus), "--overwrite")[0] == 2  # a dataset: never, flag or not
    assert corpus.read_text() == '{"_id": "d1", "text": "the user\'s"}\n'
    foreign = tmp_path / "notes" / "summary.txt"
    assert _report(capsys, str(runs), "--out", str(foreign), "--overwrite")[0] == 0
    assert GENERATOR_TAG in foreign.read_text() and _no_temporaries(tmp_path)


# ------------------------------------------------------------------------------------------------ bench gpu_check
@pytest.mark.parametrize("overwrite", [False, True])
def test_gpu_check_out_replaces_an_earlier_report_only(tmp_path, monkeypatch, capsys, overwrite):
    """--out is refused before the first check (the checks stand in here: each would take minutes) when it is a
    directory or a file that is not an earlier gpu_check report; an earlier report is replaced; --overwrite
    replaces the foreign file too. Wrong code that would still pass: recognising an earlier report by anything
    less than its keys (a user's JSON holding commit, mode, device and checks would be replaced; not tried)."""
    from benchmarks import gpu_check

    ran = []
    report = {"commit": "c", "mode": "tiny checks", "device": "cpu", "checks": {}, "passed": True, "seconds": 0.1}
    monkeypatch.setattr(gpu_check, "run_checks", lambda args, cuda_count: ran.append(1) or report)

    def check(out: Path, *flags: str) -> int:
        monkeypatch.setattr("sys.argv", ["gpu_check", "--tiny", "--out", str(out), *flags])
        return gpu_check.main()

    notes, earlier = tmp_path / "notes.json", tmp_path / "gpu_check.json"
    notes.write_text('{"mine": true}\n')
    earlier.write_text(json.dumps({**report, "commit": "older"}))
    assert check(tmp_path) == 2 and not ran
    flags = ["--overwrite"] if overwrite else []
    assert check(notes, *flags) == (0 if overwrite else 2) and len(ran) == int(overwrite)
    assert json.loads(notes.read_text()) == (report if overwrite else {"mine": True})
    assert check(earlier) == 0 and json.loads(earlier.read_text()) == report
    err = capsys.readouterr().err
    assert f"gpu_check: error: --out={tmp_path}: {tmp_path} is a directory; this command writes a file" in err, err
    refused = f"gpu_check: error: --out={notes} already holds results ({notes.name}): set --overwrite to replace them"
    assert (refused in err) == (not overwrite) and _no_temporaries(tmp_path), err
