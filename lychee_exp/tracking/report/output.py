"""Where the report page goes (`--out`), by io.outputs' policy: the page appears whole (staged, then moved into
place), never over a file the report reads (a run's metrics.json, config.yaml, ...), never over a directory, and
over an existing file only when that file is an earlier page of ours (re-running the report refreshes it) or with
--overwrite. An earlier page is recognised by the generator tag every page carries in its head."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from lychee_exp.io.outputs import staged_output

GENERATOR_TAG = '<meta name="generator" content="lychee_exp.report">'
# what the report reads below its directory (tracking.report.data)
READ = ("metrics.json", "metrics.csv", "config.yaml", "trials.csv", "optimization_results.yaml", "bench.csv")


def report_inputs(root: Path) -> list[tuple[str, str]]:
    """Every file of the kinds the report reads under root, read or skipped: each is the user's."""
    return [(f"{name}, read by the report", str(path)) for name in READ for path in sorted(root.rglob(name))]


def earlier_page(path: Path) -> bool:
    """Whether path is a page this report wrote (its tag sits in the first bytes of the head)."""
    try:
        with path.open("rb") as handle:
            return GENERATOR_TAG.encode() in handle.read(4096)
    except OSError:
        return False


@contextlib.contextmanager
def page_output(spec: str, root: Path, overwrite: bool) -> Iterator[Path]:
    """Where the page is written (a path in a staging directory), checked before the report reads anything; moved
    to `spec` (--out as the user spelled it) when the block ends. Every refusal is one UserError naming --out."""
    with staged_output(
        spec,
        directory=False,
        overwrite=overwrite,
        inputs=report_inputs(root),
        key="--out",
        ours=earlier_page,
        overwrite_flag="--overwrite",
    ) as staged:
        yield staged
