"""Resolve the paths users write in configs, including files shipped inside installed packages."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

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
