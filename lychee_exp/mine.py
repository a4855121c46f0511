"""Entry point: `python -m lychee_exp.mine dataset=<beir dir> split=train first_stage=bm25 out=<train.jsonl>`.

Writes a BEIR split as FlagEmbedding reranker JSONL with hard negatives from the first stage's ranks
(ir.mining; keys in config.commands.MineConfig), then one summary line. A user mistake is one line, exit 2.
out= is written as io.outputs says: whole or not at all, never over an input (the corpus, a run file), an
existing file only with overwrite=true; Ctrl-C leaves it as it was.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from lychee_exp.cli import run_output_command
from lychee_exp.config.commands import (
    MineConfig,
    check_mine_config,
    command_inputs,
    mine_settings,
    register_ir_schemas,
)
from lychee_exp.io.outputs import staged_output
from lychee_exp.io.progress import progress_meter, progress_shown
from lychee_exp.ir.mining import MineSummary
from lychee_exp.ir.pipeline import mine_to_file, open_split
from lychee_exp.model.files import check_trained_head

log = logging.getLogger("lychee_exp.mine")


def mine_command(cfg: MineConfig) -> str:
    check_mine_config(cfg)
    start = time.perf_counter()
    # out= is checked and locked first; the JSONL goes to a fresh file that replaces out= only when complete.
    # progress_shown: the dense encoding's progress too
    output = staged_output(cfg.out, directory=False, overwrite=cfg.overwrite, inputs=command_inputs(cfg))
    with output as staged, progress_shown(cfg.progress_bar):
        summary = _mine_into(cfg, staged)
    seconds = time.perf_counter() - start
    queries = summary.written + sum(summary.skipped.values())
    line = f"{cfg.out}: {summary.line()} ({queries / seconds:.1f} queries/s, {seconds:.1f} s)"
    log.info(line)
    return line


def _mine_into(cfg: MineConfig, out: Path) -> MineSummary:
    corpus, split = open_split(cfg.dataset, cfg.split)
    settings = mine_settings(cfg)

    def progress(items):
        return progress_meter(items, desc=f"mine {cfg.split}", unit="query", units="queries")

    if cfg.teacher == "reranker":  # before any scoring: a wrong path or model is one line
        from lychee_exp.model.reranker import model_dir  # torch: here, so that a misspelt key is answered without it

        model_dir(cfg.model)
        check_trained_head(cfg.model)
    return mine_to_file(
        corpus,
        split,
        cfg.first_stage,
        settings,
        out,
        cfg.teacher,
        cfg.dense,
        progress,
        cfg.model,
        cfg.batch_size,
        stemmer=cfg.bm25_stemmer,
    )


def main(argv: list[str] | None = None) -> None:
    register_ir_schemas()
    run_output_command("mine", argv, MineConfig, mine_command)


if __name__ == "__main__":
    main()
