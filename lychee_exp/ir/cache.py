"""One on-disk cache for what is derived from a dataset (the parsed corpus, BM25 indexes, dense embeddings,
first-stage runs, mined training files, a dev split's teacher scores): each entry is keyed by everything that
decides its content (the files it was read from by path, size, times and inode, the queries asked, the settings), so
an edited file is read again and an unchanged one never is. `LYCHEE_CACHE_DIR` moves it (tests use a temporary one).

Entries are written whole or not at all (io.atomic; Ctrl-C leaves none half written). The slow ones a training
job computes as its steps (ir.training) are computed under `computing`, so that processes needing the same entry at
once (the ranks of a torchrun job, sweep trials, the nodes of a job sharing the cache) compute it once."""

from __future__ import annotations

import hashlib
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from lychee_exp.io.lock import OutputLock

# Part of every key: bumped when what an entry holds, or the code that computes it, changes its result
FORMAT = 2


def cache_root() -> Path:
    root = os.environ.get("LYCHEE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "lychee_exp"
    return Path(root).expanduser()


def file_key(path: Path) -> list:
    """A file's identity: rewritten, or replaced by a copy with the same size and mtime, it is another file."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def directory_key(path: Path) -> list:
    """Every file below a directory (a model's weights, config and tokenizer), by file_key."""
    if path.is_file():
        return [file_key(path)]
    return [file_key(p) for p in sorted(path.rglob("*")) if p.is_file()]


def cache_path(kind: str, *parts: object, create: bool = True) -> Path:
    """<root>/<kind>/<digest of parts>: parts are JSON-able (file keys, settings, the queries asked). create=False
    (a lookup that only reads) leaves the cache as it is."""
    digest = hashlib.sha1(json.dumps([FORMAT, parts], sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_root() / kind / digest
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def computing(path: Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Held while this process computes the entry at `path`: a process that needs it meanwhile waits for as long
    as it takes (`waiting(holder)` is told once), then finds it written. A holder that dies lets go (an OS lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(path, str(path), wait_s=math.inf, waiting=waiting):
        yield
