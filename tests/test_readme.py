"""README.md says what the code does: its quick-start commands are the Makefile's targets, every command it
quotes composes (a renamed or misspelt key fails here), its links reach existing pages and headings, and the
default job's summary line and output directory are what `make run` gives (the slow tests, on the session's one
default job: conftest.default_job)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ASSETS, REPO_ROOT

from lychee_exp.cli import command_config
from lychee_exp.config.commands import MineConfig, RerankConfig, register_ir_schemas
from lychee_exp.config.schema import to_run_config
from lychee_exp.job.in_process import compose_job
from lychee_exp.job.results import summary_line
from lychee_exp.rerank import standing_line

README = (REPO_ROOT / "README.md").read_text()
# the machine README's quick-start figures were measured on; elsewhere other bf16 kernels give other figures
FIGURES_MACHINE = "2-core Intel Xeon with AMX"
NUMBER = re.compile(r"\d+\.\d+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def section(title: str) -> str:
    part = README[README.index(f"\n## {title}\n") :]
    return part[: part.index("\n## ", 1)]


def code_blocks(text: str, lang: str = "") -> list[str]:
    """The fenced blocks of a language ("": those without one)."""
    return [body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S) if tag == lang]


def commands(text: str) -> list[str]:
    """The commands of a section's bash blocks: continuation lines joined, comments dropped."""
    lines = []
    for block in code_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                lines.append(line)
    return lines


def this_machine_is_the_figures_machine() -> bool:
    """A 2-core Intel Xeon with AMX and no CUDA: the CPU README's quick-start figures were measured on."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return (
        os.cpu_count() == 2
        and "Intel(R) Xeon(R)" in cpuinfo
        and "amx_bf16" in cpuinfo
        and not torch.cuda.is_available()
    )


def masked(line: str) -> str:
    """The line's words, its figures (or README's letters for them: X, Y, Z, M) as N."""
    return re.sub(r"\b[XYZM]\b", "N", NUMBER.sub("N", line))


# --- the quick start's commands


def make_dry_run(target: str, venv: Path) -> list[str]:
    # not the flags of a make this suite runs under (`make test ARGS=...` hands ARGS down through MAKEFLAGS)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")}
    proc = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return [line.strip() for line in proc.stdout.splitlines()]


def test_the_quick_start_commands_are_the_makefile_targets_that_run_and_test(tmp_path):
    assert commands(section("Quick start")) == ["make run", "make test"]
    venv = tmp_path / "venv"  # an installed venv: make's dry run shows the target's own command last
    (venv / ".installed").parent.mkdir()
    (venv / ".installed").touch()
    assert make_dry_run("run", venv)[-1] == f"{venv}/bin/python -m lychee_exp.run"
    assert make_dry_run("test", venv)[-1] == f"{venv}/bin/python -m pytest"
    # without one, make sets it up first (README: "set up .venv if needed")
    assert make_dry_run("run", tmp_path / "none")[0].startswith("bash launch/setup_env.sh")


def test_every_make_target_the_readme_names_exists(tmp_path):
    targets = {line.split()[1] for line in commands(README) if line.startswith("make ")}
    assert {"run", "test", "test-fast", "lint"} <= targets
    (tmp_path / ".installed").touch()
    for target in targets:
        make_dry_run(target, tmp_path)


# --- every command README quotes composes with today's keys


def placeholders(tmp_path: Path) -> dict[str, str]:
    beir = str(ASSETS / "beir_sample")
    return {
        "<beir dir>": beir,
        "<train.jsonl>": str(tmp_path / "train.jsonl"),
        "<run dir>/model": str(ASSETS / "tiny_qwen2"),
        "<dir>": str(tmp_path / "out"),
        "<stamp>": "2026-12-07_00-00-00_abcd",
        "model.path=...": "model.path=/models/lychee-rerank",
    }


def quoted_commands(tmp_path: Path) -> list[tuple[str, list[str]]]:
    """(entry point, its key=value arguments) of every lychee_exp command README quotes, placeholders filled."""
    found = []
    for line in commands(README):
        for name, value in placeholders(tmp_path).items():
            line = line.replace(name, value)
        words = shlex.split(line)
        if words[:2] == ["python", "-m"] and words[2].startswith("lychee_exp."):
            found.append((words[2].removeprefix("lychee_exp."), [w for w in words[3:] if w != "-m"]))
        elif words[0] == "launch/torchrun.sh":  # the same overrides as `run`
            found.append(("run", words[1:]))
    return found


def test_readme_quotes_the_commands_this_test_composes(tmp_path):
    names = [name for name, _ in quoted_commands(tmp_path)]
    assert {"run", "mine", "rerank", "plan"} <= set(names) and names.count("run") >= 10


def test_every_training_command_readme_quotes_composes_to_a_checked_config(tmp_path):
    """`run`'s and `plan`'s (the same config) and the torchrun script's; `report` and `dashboard` take flags."""
    for name, args in quoted_commands(tmp_path):
        if name in ("run", "plan"):
            # a misspelt or renamed key (hydra.* included) raises in compose, a wrong value in the schema's checks
            to_run_config(compose_job(args, tmp_path / "run"))


def test_the_beir_walkthrough_commands_compose_on_the_built_in_set(tmp_path):
    """README's "From a BEIR dataset to a reranked test run", on pkg://lychee_exp.assets/beir_sample: mine's and
    rerank's typed configs, and the training run's with the mined file as its train_file."""
    register_ir_schemas()
    lines = commands(section("From a BEIR dataset to a reranked test run"))
    assert [line.split()[2] for line in lines] == ["lychee_exp.mine", "lychee_exp.run", "lychee_exp.rerank"]
    by_name = {name: args for name, args in quoted_commands(tmp_path) if name in ("mine", "rerank")}
    mine = command_config("mine", by_name["mine"], MineConfig)
    assert (mine.split, Path(mine.out).name) == ("train", "train.jsonl")
    rerank = command_config("rerank", by_name["rerank"], RerankConfig)
    assert rerank.split == "test" and Path(rerank.model.path) == ASSETS / "tiny_qwen2"
    run = [args for name, args in quoted_commands(tmp_path) if "data=beir" in args][0]
    cfg = to_run_config(compose_job(run, tmp_path / "run"))
    assert (cfg.data.name, cfg.data.dataset, cfg.data.dev_split) == ("beir", str(ASSETS / "beir_sample"), "dev")
    assert cfg.data.train_file == mine.out


def test_the_rerank_lines_readme_quotes_have_rerank_s_format():
    """The line `rerank` ends with, as README spells it (X, Y, Z, M) and as it quotes it with figures."""
    quoted = re.findall(r"`(ndcg@10: model alone [^`]+)`", section("From a BEIR dataset to a reranked test run"))
    assert len(quoted) == 2
    for line in (" ".join(q.split()) for q in quoted):  # a quote may wrap across lines
        values = [float(v) for v in NUMBER.findall(line)] or [0.0] * 4
        metrics = {"model_ndcg@10": values[0], "first_stage_ndcg@10": values[1], "teacher_ndcg@10": values[2]}
        assert masked(standing_line({**metrics, "ndcg@10": values[3]}, "bm25")) == masked(line)


# --- links


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (REPO_ROOT / "docs").glob("*.md"))])
def test_relative_links_reach_an_existing_file_and_heading(page):
    path = REPO_ROOT / page if page == "README.md" else REPO_ROOT / "docs" / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest)):
            broken.append(target)
    assert not broken, f"{page}: {broken}"


# --- the default job (slow: minutes on CPU, shared with tests/test_default_job.py)


def quoted_summary_line() -> str:
    blocks = [b.strip() for b in code_blocks(section("Quick start")) if b.startswith("dev ndcg@10:")]
    assert len(blocks) == 1
    # the figures name their machine and date
    assert f"({FIGURES_MACHINE}, 2026-" in " ".join(section("Quick start").split())
    return blocks[0]


@pytest.mark.slow
def test_the_quoted_summary_line_is_the_default_job_s(default_job):
    """The format always, BM25's and the teacher's figures (the dev file's) everywhere, the model's and the mix's on
    the machine README names."""
    quoted = quoted_summary_line()
    metrics = default_job.metrics
    ours = summary_line(metrics, "bm25")
    assert ours in default_job.run_log  # what the run printed
    assert masked(ours) == masked(quoted)
    for name in ("BM25", "teacher"):
        assert re.search(rf"{name} (\d\.\d+)", ours).group(1) == re.search(rf"{name} (\d\.\d+)", quoted).group(1)
    if this_machine_is_the_figures_machine():
        assert ours == quoted
    else:
        print(f"\nnot the {FIGURES_MACHINE} README names: its figures are not compared ({ours})", file=sys.stderr)


def listed_outputs() -> set[str]:
    """The top-level entries README's Outputs paragraph names (files and directories/)."""
    text = section("Outputs").split("\n\n")[1]
    text = re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", text)  # what is in brackets describes an entry
    return set(re.findall(r"`([.\w]+/?)`", text)) - {"outputs/runs/<stamp>/"}


@pytest.mark.slow
def test_the_outputs_readme_lists_are_what_the_default_job_writes(default_job):
    """Every entry of the default job's directory is listed; a listed entry it lacks is one its config turned off."""
    written = {p.name + ("/" if p.is_dir() else "") for p in default_job.run_dir.iterdir()}
    listed = listed_outputs()
    assert written <= listed, f"README's Outputs omits {written - listed}"
    run_cfg = default_job.config  # the run's own settings decide the optional entries
    optional = {
        "checkpoints/": run_cfg["trainer"]["checkpoint_every"] == 0,
        "tensorboard/": not (run_cfg["logger"]["name"] == "tensorboard" or run_cfg["logger"]["tensorboard"]),
    }
    assert listed - written == {entry for entry, off in optional.items() if off}
