"""A throwaway PostgreSQL server on 127.0.0.1 for the shared-study tests and the storage benchmark.

Debian's server binaries (postgresql-15) are on the machine but not running; postgres refuses to run as root,
so as root the server runs as the postgres user, in a directory outside any 0700 temporary tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lychee_exp.launch.processes import free_port


def server_bindir() -> Path | None:
    """The newest installed PostgreSQL's bin directory, or None."""
    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return bins[-1].parent if bins else None


@contextmanager
def local_postgres(max_connections: int = 100) -> Iterator[str]:
    """Starts a server with an `optuna` database and yields its SQLAlchemy URL; stops and deletes it after."""
    bindir = server_bindir()
    if bindir is None:
        raise FileNotFoundError("no PostgreSQL server binaries in /usr/lib/postgresql (apt-get install postgresql)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="lychee-pg-"))
    data = root / "data"
    data.mkdir()
    if as_user:
        shutil.chown(root, "postgres")
        shutil.chown(data, "postgres")
    port = free_port()

    def run(*cmd: str, check: bool = True) -> None:
        subprocess.run([*as_user, str(bindir / cmd[0]), *cmd[1:]], check=check, capture_output=True)

    try:
        run("initdb", "-D", str(data), "-A", "trust", "-U", "postgres")
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections={max_connections}"
        run("pg_ctl", "-D", str(data), "-l", str(root / "server.log"), "-w", "-o", options, "start")
        run("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "optuna")
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/optuna"
    finally:
        run("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop", check=False)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from lychee_exp.cli import library_module

    library_module(__spec__.name, __doc__, "benchmarks.optuna_storage")
