"""One on-disk cache for what is derived from a dataset (the parsed corpus, BM25 indexes, dense embeddings,
first-stage runs, mined training files): keyed by the files it was read from (path, size, mtime), so an edited
file is read again and an unchanged one never is. `LYCHEE_CACHE_DIR` moves it (tests use a temporary one)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("LYCHEE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "lychee_exp"
    return Path(root).expanduser()


def file_key(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def cache_path(kind: str, *parts: object) -> Path:
    """<root>/<kind>/<digest of parts>: parts are JSON-able (file keys, settings)."""
    digest = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_root() / kind / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
