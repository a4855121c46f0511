"""The files users give: the paths they write in configs resolved (files shipped inside installed packages included,
as `pkg://package/path`), and the lines of their UTF-8 text files (JSONL, TSV, TREC), numbered from 1: a byte
sequence that is not UTF-8 is one UserError naming the file, line and column, not a UnicodeDecodeError from somewhere
inside a reader. A UTF-8 byte-order mark at the start of the file is dropped (editors on Windows write one)."""

from __future__ import annotations

import codecs
import importlib.resources
from pathlib import Path
from typing import Iterator

from lychee_exp.errors import UserError

PKG_SCHEME = "pkg://"


def resolve_path(spec: str, key: str, must_exist: bool = True) -> Path:
    """`pkg://package.name/sub/path` points inside an installed package (Hydra's spelling for search paths)."""
    if spec.startswith(PKG_SCHEME):
        package, _, rest = spec[len(PKG_SCHEME) :].partition("/")
        try:
            root = importlib.resources.files(package)
        except ModuleNotFoundError:
            raise UserError(f"{key}={spec}: package {package!r} is not installed") from None
        path = Path(str(root)) / rest
    else:
        path = Path(spec).expanduser()
    if must_exist and not path.exists():
        raise UserError(f"{key}={spec}: {path} does not exist")
    return path


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) for each line, its line ending kept as in the file ("\\n" or "\\r\\n")."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(
                    f"{path}:{number}: not UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line); "
                    "save the file as UTF-8"
                ) from None
