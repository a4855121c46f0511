"""Writes that readers see whole or not at all: the text goes to a temporary file beside the target, which
then replaces it in one rename. The temporary name carries the pid, so two processes writing the same file
(sweep workers, concurrent runs sharing a baseline cache) never write into each other's temporary file.

A file that several processes read, change and write back (the speedup baseline cache, a sweep's results)
is changed under `locked(path)`, an OS file lock (io.lock, the one every output is written under) on a
short hidden file beside it: without it two runs that end together both read the old table and the later rename
drops the other's entry. The lock file goes when its holder lets go (a waiter that had opened the removed file
sees that and locks the new one), so no lock files pile up beside results."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from lychee_exp.io.lock import OutputLock, short_name

LOCK_TIMEOUT_S = 120  # a writer holds the lock for one read and one rename; minutes mean a stuck filesystem


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{short_name(path)}.{os.getpid()}.tmp")  # short: a name near NAME_MAX still fits
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the write or the rename failed


def write_json_atomic(path: Path, payload: dict) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict:
    """The JSON table at `path`, or {} when it is missing or unreadable (a cache that may be deleted any time)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds the inter-process lock of `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(path, str(path), wait_s=LOCK_TIMEOUT_S):
        yield


def update_json_locked(path: Path, update: Callable[[dict], None]) -> None:
    """Reads the JSON table at `path` ({} when missing or unreadable), lets `update` change it in place and
    writes it back, all under the file's lock, so that concurrent updates of different keys all stay."""
    with locked(path):
        table = read_json(path)
        update(table)
        write_json_atomic(path, table)
