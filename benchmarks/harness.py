"""The one harness of every side-by-side benchmark here: rounds that run each system once (the order rotating, so
that no system always runs first and load changes hit all of them), each system run in a fresh process where the
benchmark asks for one, medians over rounds, each row's ratio to the fastest peer of its precision, and the table
written as CSV and markdown. Every system runs in each precision under test (`--precision fp32,bf16`), as a run
of its own named `system:precision`."""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import logging
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lychee_exp.errors import RunFailed, UserError, command_main
from lychee_exp.io.outputs import Inputs, interrupted_line, resolved, staged_output

log = logging.getLogger("benchmarks.harness")
CHILD_FLAG = "--child"
PRECISIONS = ("fp32", "bf16")


def precisions(text: str) -> list[str]:
    """`--precision`'s value: a comma-separated list of fp32 and bf16 (argparse type)."""
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    if not chosen or set(chosen) - set(PRECISIONS):
        raise argparse.ArgumentTypeError(f"--precision takes {','.join(PRECISIONS)} or one of them, not {text!r}")
    return list(dict.fromkeys(chosen))


def add_precision_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        type=precisions,
        default=",".join(PRECISIONS),
        help="precisions to run every system in (each its own row): fp32, bf16 or both",
    )


def run_name(system: str, precision: str) -> str:
    """A run's name in the rounds (and its directory's): one system in one precision."""
    return f"{system}:{precision}"


def split_run_name(name: str) -> tuple[str, str]:
    system, precision = name.rsplit(":", 1)
    return system, precision


def turn_order(names: Sequence[str], round_: int) -> list[str]:
    """Every name once, starting at a different one each round."""
    start = round_ % len(names) if names else 0
    return [*names[start:], *names[:start]]


def in_rounds(names: Sequence[str], rounds: int, run_one: Callable[[str, int], Any]) -> dict[str, list]:
    """{name: its results in round order}: `run_one(name, round_)` for every name in every round, in turns;
    a None result (a failed run, already reported) is left out."""
    results: dict[str, list] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in turn_order(names, round_):
            result = run_one(name, round_)
            if result is not None:
                results[name].append(result)
                log.info("round %d %s: %s", round_, name, result)
    return results


def run_child(module: str, name: str, spec: dict, env: dict[str, str]) -> dict | None:
    """`python -m module --child name SPEC`: one system's run in a fresh process; its row (the last line it
    prints, as JSON), or None when it failed (its error is logged)."""
    cmd = [sys.executable, "-m", module, CHILD_FLAG, name, json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, check=False)
    if proc.returncode != 0:
        log.error("%s failed:\n%s", name, proc.stderr[-3000:])
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lychee_run(overrides: Sequence[str], run_dir: Path) -> dict:
    """`python -m lychee_exp.run <overrides>` in a process of its own, as a user runs it (every default the
    overrides leave alone, checkpoints included), into `run_dir`; returns its metrics.json, whose
    train_tokens_per_s is the figure the user reads. A failed run raises RuntimeError with its last stderr."""
    cmd = [sys.executable, "-m", "lychee_exp.run", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m lychee_exp.run failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "metrics.json").read_text())


def child_call(argv: list[str], child: Callable[[str, dict], dict]) -> bool:
    """In a process `run_child` started: runs the system and prints its row; False in the parent process."""
    if argv[:1] != [CHILD_FLAG]:
        return False
    print(json.dumps(child(argv[1], json.loads(argv[2]))))
    return True


def medians(runs: list[dict], keys: Sequence[str]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in keys}


def add_ratio_to_fastest(rows: list[dict], peers: Sequence[str], key: str = "tokens_per_s") -> None:
    """Sets each row's vs_fastest_peer: its `key` over the best peer's of the same precision (NaN when no peer
    has a row in it), so that a bf16 row is never measured against fp32 peers (a row without a precision is
    one of its own kind: those are compared among themselves)."""
    fastest: dict[str | None, float] = {}
    for row in rows:
        if row["system"] in peers:
            fastest[row.get("precision")] = max(fastest.get(row.get("precision"), 0.0), row[key])
    for row in rows:
        best = fastest.get(row.get("precision"), 0.0)
        row["vs_fastest_peer"] = row[key] / best if best else float("nan")


@dataclass(frozen=True)
class Column:
    """One column of the markdown table: its header and how a row's cell reads."""

    header: str
    cell: Callable[[dict], str]


SYSTEM = Column("system", lambda r: r["system"])
PRECISION = Column("precision", lambda r: r["precision"])
PAIRS_PER_S = Column("pairs/s", lambda r: f"{r['pairs_per_s']:.1f}")
TOKENS_PER_S = Column("non-pad tokens/s", lambda r: f"{r['tokens_per_s']:.0f}")
VS_FASTEST_PEER = Column("vs fastest peer", lambda r: f"{r['vs_fastest_peer']:.2f}")


def padding_column(header: str) -> Column:
    return Column(header, lambda r: f"{r['padding_share']:.0%}")


def markdown_table(rows: list[dict], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.cell(row) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict], fields: Sequence[str]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows({key: row[key] for key in fields} for row in rows)


def add_output_options(parser: argparse.ArgumentParser, default: str) -> None:
    """--out and --overwrite, as every benchmark spells them (bench_output says what they do)."""
    parser.add_argument(
        "--out", default=None, help=f"output directory, written whole when the benchmark ends (default: {default})"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an --out that holds this benchmark's results (only those)"
    )


def fresh_out(kind: str, suffix: str = "", root: Path | str = "outputs") -> str:
    """The default --out: <root>/<kind>/<time stamp><suffix>, or -2, -3, ... after it when a benchmark started in
    the same second wrote that one already (a default never names earlier results)."""
    base = Path(root) / kind / f"{datetime.now():%Y-%m-%d_%H-%M-%S}{suffix}"
    candidates = itertools.chain([base], (base.with_name(f"{base.name}-{n}") for n in itertools.count(2)))
    return str(next(path for path in candidates if not path.exists()))


@contextlib.contextmanager
def bench_output(spec: str, writes: Sequence[str], overwrite: bool, inputs: Inputs = ()) -> Iterator[Path]:
    """The directory a benchmark writes everything into, by the policy of every command (io.outputs,
    docs/outputs.md): a fresh hidden directory beside --out, moved into place whole when the benchmark ends (Ctrl-C,
    a failure or a full disk leave an earlier --out as it was). An --out that holds anything is refused in one line
    unless --overwrite, and even then it is replaced only if it holds nothing but what this benchmark writes
    (`writes`: regular expressions of those names, e.g. `devices_\\d+`); one that is, holds or lies inside an input,
    a run, a model or a dataset is refused; so is a path that names no writable local directory."""
    ours = [name for name in _held(spec) if any(re.fullmatch(pattern, name) for pattern in writes)]
    try:
        with staged_output(
            spec,
            directory=True,
            overwrite=overwrite,
            inputs=inputs,
            results=ours,
            key="--out",
            overwrite_flag="--overwrite",
        ) as staging:
            yield staging
    except NothingMeasured:  # raised inside: the staging directory is gone (a RunFailed would keep it for its logs)
        raise RunFailed("every system failed (see the messages above)", "crashed") from None


class NothingMeasured(Exception):
    """Every system of a side-by-side benchmark failed (each said why): nothing to write, exit 1."""


def bench_main(command: Callable[[], int | None], out: str) -> int:
    """A benchmark's main around command(), as every command's (errors.command_main): a user mistake or a failure
    is one line (exit 2 or 1), Ctrl-C one line saying what --out was left as (130), SIGTERM the same (143)."""
    return command_main(command, lambda: interrupted_line(out))


def checked_config(overrides: Sequence[str], output_dir: Path | str) -> Any:
    """The run config that `overrides` compose (with its run directory at output_dir, created by nothing here),
    checked as `python -m lychee_exp.run` checks it: a config that does not compose (`model=nosuch`, a misspelt
    key) is one UserError line naming the key (and a config group's options)."""
    from hydra.errors import ConfigCompositionException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from lychee_exp.cli import composition_error
    from lychee_exp.config.schema import to_run_config
    from lychee_exp.job.in_process import compose_job

    try:
        return to_run_config(compose_job(overrides, output_dir))
    except (ConfigCompositionException, OverrideParseException) as err:
        raise UserError(composition_error(err)) from None
    except OmegaConfBaseException as err:
        raise UserError(f"{err.full_key or 'config'}: {str(err).splitlines()[0]}") from None


def _held(spec: str) -> list[str]:
    """The names in an existing --out directory; none for anything else (staged_output says what is wrong)."""
    if not spec.strip():
        return []
    try:
        return sorted(entry.name for entry in resolved(spec).iterdir())
    except OSError:  # no such directory, a file, a name too long, ...
        return []


def log_to_console() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")


# the benchmarks built on this harness (what running it names)
USED_BY = (
    "peers",
    "own_batching",
    "scaling",
    "ir_throughput",
    "padded_vs_packed",
    "sweep_overhead",
    "sweep_throughput",
)

if __name__ == "__main__":
    from lychee_exp.cli import library_module

    library_module(__spec__.name, __doc__, *(f"benchmarks.{name}" for name in USED_BY))
