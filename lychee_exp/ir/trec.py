"""TREC files: qrels (`qid 0 docid rel`) and runs (`qid Q0 docid rank score tag`), read with one UserError per
malformed line or byte that is not UTF-8 (file:line), written whole or not at all (io.atomic)."""

from __future__ import annotations

from pathlib import Path

from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.io.user_files import numbered_lines

Run = dict[str, dict[str, float]]  # query id -> document id -> score (higher = more relevant)
SCORE_FORMAT = "{:.6f}"  # what a run file keeps of a score; metrics are computed on the scores as written


def ranked(scores: dict[str, float]) -> list[tuple[str, float]]:
    """trec_eval's order: score descending, ties by document id descending (its qsort on docno)."""
    return sorted(scores.items(), key=lambda item: (item[1], item[0]), reverse=True)


def as_written(run: Run) -> Run:
    """The scores a run file will hold, so that metrics of a run equal those of its file."""
    return {qid: {doc: float(SCORE_FORMAT.format(s)) for doc, s in docs.items()} for qid, docs in run.items()}


def write_run(path: Path, run: Run, tag: str) -> None:
    lines = []
    for qid in sorted(run):
        for rank, (doc, score) in enumerate(ranked(run[qid]), start=1):
            lines.append(f"{qid} Q0 {doc} {rank} {SCORE_FORMAT.format(score)} {tag}\n")
    write_text_atomic(path, "".join(lines))


def read_run(path: Path, key: str = "run") -> Run:
    run: Run = {}
    for where, cols in _lines(path, key):
        if len(cols) != 6:
            raise UserError(f"{where}: expected 'qid Q0 docid rank score tag' (6 columns), got {len(cols)}")
        try:
            score = float(cols[4])
        except ValueError:
            raise UserError(f"{where}: score {cols[4]!r} is not a number") from None
        run.setdefault(cols[0], {})[cols[2]] = score
    return run


def write_qrels(path: Path, qrels: dict[str, dict[str, int]]) -> None:
    lines = [f"{qid} 0 {doc} {rel}\n" for qid in sorted(qrels) for doc, rel in sorted(qrels[qid].items())]
    write_text_atomic(path, "".join(lines))


def read_qrels(path: Path, key: str = "qrels") -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    for where, cols in _lines(path, key):
        if len(cols) != 4:
            raise UserError(f"{where}: expected 'qid 0 docid rel' (4 columns), got {len(cols)}")
        try:
            qrels.setdefault(cols[0], {})[cols[2]] = int(cols[3])
        except ValueError:
            raise UserError(f"{where}: relevance {cols[3]!r} is not an integer") from None
    return qrels


def _lines(path: Path, key: str):
    if not path.is_file():
        raise UserError(f"{key}: {path} does not exist")
    found = False
    for number, line in numbered_lines(path):
        if line.strip():
            found = True
            yield f"{path}:{number}", line.split()
    if not found:
        raise UserError(f"{key}: {path} is empty")
