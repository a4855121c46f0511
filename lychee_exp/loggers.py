"""Experiment loggers. Only the main process (global rank 0) gets a real one; every other rank a NullLogger."""
from __future__ import annotations

import csv
from pathlib import Path


class NullLogger:
    def log_metrics(self, metrics: dict, step: int) -> None:
        pass

    def log_summary(self, summary: dict) -> None:
        pass

    def truncate(self, step: int) -> None:
        """Forget what was logged after `step` (a resumed run logs those steps again)."""

    def finish(self) -> None:
        pass


class CSVLogger(NullLogger):
    """metrics.csv in the run directory, one row per logged step, as Lightning's CSVLogger writes it."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / "metrics.csv"
        self.rows: list[dict] = []

    def truncate(self, step: int) -> None:
        if self.path.is_file():
            with self.path.open(newline="") as handle:
                self.rows = [row for row in csv.DictReader(handle) if int(row["step"]) <= step]

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append({"step": step, **metrics})
        self._write()

    def _write(self) -> None:
        # Columns grow as new metrics appear (eval rows), so the small file is rewritten whole.
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        with self.path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)


def make_logger(name: str, output_dir: Path, is_main: bool) -> NullLogger:
    if not is_main or name == "none":
        return NullLogger()
    return CSVLogger(output_dir)
