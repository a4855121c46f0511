"""One command-line grammar (lychee_exp.cli): `--help` of run, mine, rerank and plan lists every key of the command's
schema with its default and the schema's comment (config.key_docs); `--cfg job` prints the composed config and runs
nothing; an unknown flag is one line. And every module a user can run (`python -m lychee_exp.*`, `benchmarks.*`,
`tools.*`) answers `--help` with what it does and each of its arguments."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from lychee_exp.cli import command_help, override_value, split_flags
from lychee_exp.config.commands import MineConfig, RerankConfig, register_ir_schemas
from lychee_exp.config.key_docs import field_comments, key_docs
from lychee_exp.config.rules import at_least, declared_in
from lychee_exp.config.schema import RunConfig
from lychee_exp.errors import UserError
from lychee_exp.job.context import register_config

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Owner:
    shared: int = 3  # the owner's words


@dataclass
class Documented:
    # above,
    # on two lines
    first: int = at_least(0, 1)  # and beside
    plain: str = "x"
    wrapped: list = field(  # fmt: skip
        default_factory=list
    )  # closing line
    shared: int = declared_in(Owner, "shared")
    mine: int = declared_in(Owner, "shared")  # my own words


def test_key_docs_read_comments_above_beside_and_from_a_shared_keys_owner():
    comments = field_comments(Documented)
    assert comments["first"] == "above, on two lines and beside"
    assert comments["plain"] == ""
    assert comments["wrapped"] == "closing line"  # the pragma left out, the field's last line read
    docs = {doc.key: doc.comment for doc in key_docs(Documented)}
    assert docs["shared"] == "the owner's words" and docs["mine"] == "my own words"


def test_key_docs_list_nested_groups_keys_after_their_group():
    keys = [(doc.key, doc.nested) for doc in key_docs(MineConfig)]
    assert ("dense", True) in keys and ("model.lora", True) in keys
    assert keys.index(("dense", True)) + 1 == keys.index(("dense.model", False))
    assert ("model.prompt.max_len", False) in keys


def test_override_values_read_back_as_the_same_value():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    values = (None, True, 3, 0.05, "bm25", "", "a b", "it's", "{query}", ["q_proj", "v_proj"], "run:x.trec")
    for value in (*values, "pkg://a/b", "C:\\dir", "end\\", "quote\\'d", "x=y, z"):
        parsed = parser.parse_override(f"key={override_value(value)}").value()
        assert parsed == value, (value, override_value(value), parsed)
    assert override_value("\n") == "'\\n'"  # shown for reading: the grammar has no escape for a newline


@pytest.mark.parametrize(
    ("config_name", "schema", "register", "expected"),
    [
        ("mine", MineConfig, register_ir_schemas, ["out=???", "range_max=100", "the JSONL to write"]),
        ("rerank", RerankConfig, register_ir_schemas, ["top_k=100", "parallel.strategy=single"]),
        ("config", RunConfig, register_config, ["trainer.max_steps=120", "model.lora.r=64", "data: beir, jsonl"]),
    ],
)
def test_help_lists_every_key_with_its_default_and_comment(config_name, schema, register, expected):
    register()
    text = command_help(config_name, [], schema)
    keys = [doc for doc in key_docs(schema) if not doc.nested]
    for doc in keys:
        assert re.search(rf"^{re.escape(doc.key)}=", text, re.M), doc.key
        first_words = " ".join(doc.comment.split()[:3])
        assert not doc.comment or first_words in " ".join(text.split()), (doc.key, first_words)
    for piece in expected:
        assert piece in text, piece
    assert "== Configuration groups ==" in text and "model: " in text and "minilm_cross_encoder*" in text
    assert "--cfg job" in text and "docs/outputs.md" in text


def test_help_shows_the_defaults_the_overrides_before_it_compose():
    register_ir_schemas()
    text = command_help("rerank", ["model=tiny_lychee", "top_k=7"], RerankConfig)
    assert re.search(r"^top_k=7 ", text, re.M) and re.search(r"^model\.name=tiny_lychee", text, re.M)
    assert "tiny_lychee*" in text


def test_flags_are_split_from_overrides_and_an_unknown_flag_is_refused():
    flags, overrides = split_flags(["a=1", "-c", "job", "--resolve", "b=2"], "cmd")
    assert (flags.cfg, flags.resolve, flags.help, overrides) == ("job", True, False, ["a=1", "b=2"])
    assert split_flags(["--cfg=job"], "cmd")[0].cfg == "job"
    with pytest.raises(UserError, match=r"^--fast: no such flag"):
        split_flags(["--fast"], "cmd")
    with pytest.raises(UserError, match=r"^--cfg hydra: "):
        split_flags(["--cfg", "hydra"], "cmd")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("command", ["lychee_exp.mine", "lychee_exp.rerank"])
def test_cfg_job_prints_the_composed_config_and_runs_nothing(command, tmp_path):
    out = tmp_path / "out"
    proc = cli(
        command,
        f"dataset={tmp_path / 'missing'}",
        f"out={out}",
        "top_k=9" if "rerank" in command else "range_max=9",
        "--cfg",
        "job",
    )
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["dataset"] == str(tmp_path / "missing") and printed["model"]["name"] == "minilm_cross_encoder"
    assert printed.get("top_k", printed.get("range_max")) == 9
    assert not out.exists() and not proc.stderr.strip()


def test_plan_answers_cfg_job_help_and_an_unknown_flag_in_its_grammar():
    proc = cli("lychee_exp.plan", "gpus=2", "-c", "job")
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout)["gpus"] == 2, proc.stderr
    proc = cli("lychee_exp.plan", "gpus=2", "--dry")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --dry: no such flag (python -m lychee_exp.plan takes key=value overrides, --cfg job and --help)"
    ]
    proc = cli("lychee_exp.plan", "--help")
    assert proc.returncode == 0 and re.search(r"^device_gib=\[24.0,80.0,141.0\]", proc.stdout, re.M)


def test_run_help_reads_as_the_commands():
    proc = cli("lychee_exp.run", "experiment=lychee_lora", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "== Keys ==" in proc.stdout and re.search(r"^model\.lora\.enabled=true", proc.stdout, re.M)
    assert "--hydra-help" in proc.stdout and "trainer.resume=auto" in proc.stdout  # conf/config.yaml's footer


# ---- every runnable module answers --help


def runnable_modules() -> list[str]:
    """Modules with a `__main__` guard, and packages with a __main__.py, under the packages a user runs."""
    found = []
    for package in ("lychee_exp", "benchmarks", "tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if path.name == "__main__.py":
                found.append(name.removesuffix(".__main__"))
            elif 'if __name__ == "__main__":' in path.read_text():
                found.append(name)
    return found


def test_the_walk_finds_the_commands():
    modules = runnable_modules()
    assert {"lychee_exp.run", "lychee_exp.mine", "benchmarks", "benchmarks.gpu.worker", "tools.local_slurm"} <= set(
        modules
    )


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[object, str, list[argparse.ArgumentParser]]]:
    """Each runnable module's `--help`, run in this process (one import of torch for all of them, instead of a
    process each): (its exit code, what it printed, the argparse parsers that printed it)."""
    answers, parsers = {}, []
    original = argparse.ArgumentParser.print_help

    def recording(self, file=None):
        parsers.append(self)
        original(self, file)

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(argparse.ArgumentParser, "print_help", recording)
        # runpy's note that a package's import brought in the module it is about to run (benchmarks/__init__.py
        # imports benchmarks.peers): true of `python -m` too, and harmless for a --help
        warnings.filterwarnings("ignore", r".* found in sys.modules after import of package", RuntimeWarning)
        for module in runnable_modules():
            parsers.clear()
            patch.setattr(sys, "argv", [module, "--help"])
            out, code = io.StringIO(), 0
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    runpy.run_module(module, run_name="__main__")
                except SystemExit as stop:
                    code = stop.code
            answers[module] = (code, out.getvalue(), list(parsers))
    return answers


@pytest.mark.parametrize("module", runnable_modules())
def test_every_runnable_module_answers_help_with_what_it_does_and_its_arguments(module, helps):
    code, text, parsers = helps[module]
    assert code in (0, None) and text.strip(), f"{module}: exit {code}\n{text}"
    if "== Keys ==" in text:  # a key=value command (cli.command_help): its keys are tested above
        return
    assert re.match(r"usage:\s+python -m ", text), text  # a usage a user can type, not a file name
    (parser,) = parsers
    assert parser.description, f"{module}: no description of what it does"
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help, f"{module}: {'/'.join(action.option_strings) or action.dest} has no help"
