"""Experiment loggers (metrics.csv, W&B, TensorBoard). Only the main process (global rank 0) gets real ones; every
other rank a NullLogger, so a DDP run is one W&B run (one set of event files), never one per rank."""

from __future__ import annotations

import csv
import json
import logging
import math
import netrc
import os
import shutil
from io import StringIO
from pathlib import Path
from urllib.parse import urlparse

from lychee_exp.config.schema import LoggerConfig, RunConfig, plain_dict
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.tracking.keys import HISTORY
from lychee_exp.tracking.trial import current_trial

log = logging.getLogger(__name__)


class NullLogger:
    def log_metrics(self, metrics: dict, step: int) -> None:
        pass

    def log_summary(self, summary: dict) -> None:
        pass

    def truncate(self, step: int) -> None:
        """Forget what was logged after `step` (a resumed run logs those steps again)."""

    def log_table(self, name: str, columns: list[str], rows: list[list], image: Path | None = None) -> None:
        pass

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
        # Columns grow as new metrics appear (eval rows), so the small file is rewritten whole.
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        table = StringIO()
        writer = csv.DictWriter(table, fieldnames=columns)
        writer.writeheader()
        writer.writerows(self.rows)
        # whole or not at all: a run killed mid-write keeps the previous table, which its resume reads back
        write_text_atomic(self.path, table.getvalue())


def has_wandb_api_key() -> bool:
    """An API key in the environment or in ~/.netrc (what `wandb login` writes); never read into logs."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(cfg: LoggerConfig) -> str:
    """The W&B mode a run gets: WANDB_MODE=disabled turns W&B off whatever logger.mode says (nothing is written:
    no wandb/ directory); otherwise logger.mode, where `auto` reads WANDB_MODE (online, offline; dryrun is its old
    spelling of offline), then online with an API key, else offline."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env == "disabled":
        return "disabled"
    if str(cfg.mode) != "auto":
        return str(cfg.mode)
    if env in ("online", "offline", "dryrun"):
        return "offline" if env == "dryrun" else env
    return "online" if has_wandb_api_key() else "offline"


_requirements_saved = False  # set by this process's first W&B run


class WandbLogger(NullLogger):
    """One W&B run. Offline without an API key; an unreachable server costs at most init_timeout_s, after
    which the run continues offline (what it logged can be uploaded later with `wandb sync`)."""

    def __init__(self, cfg: LoggerConfig, output_dir: Path, name: str, group: str, job_type: str, config: dict):
        import wandb

        mode = wandb_mode(cfg)
        kwargs = {
            "project": cfg.project,
            "entity": cfg.entity,
            "name": name,
            "group": cfg.group or group,
            "job_type": cfg.job_type or job_type,
            "tags": list(cfg.tags),
            "config": config,
            "dir": str(output_dir),
            "reinit": "create_new",
        }  # consecutive trials in one process: new runs
        global _requirements_saved
        # requirements.txt lists every installed package (importlib.metadata over ~120 distributions: 0.3-0.7 s a
        # run); a process's later runs (warm trials of a sweep) have the same environment, so only its first saves it
        settings = wandb.Settings(
            init_timeout=cfg.init_timeout_s, silent=True, console="off", x_save_requirements=not _requirements_saved
        )
        _requirements_saved = True
        wandb_dir = output_dir / "wandb"
        before = set(wandb_dir.glob("run-*")) if wandb_dir.is_dir() else set()
        try:
            self.run = wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure to reach W&B must not stop training
            if mode != "online":
                raise
            log.warning("W&B unreachable (%s); continuing offline", str(err).splitlines()[0][:200])
            for partial in set(wandb_dir.glob("run-*")) - before:  # the failed online attempt's local files
                shutil.rmtree(partial, ignore_errors=True)
            mode = "offline"
            self.run = wandb.init(mode=mode, settings=settings, **kwargs)
        self.mode = mode
        self.run.define_metric(HISTORY["dev_ndcg"], summary="max")
        self.run.define_metric(HISTORY["dev_mrr"], summary="max")
        if mode == "offline":
            log.info("W&B run offline in %s; upload it with: wandb sync %s", self.run.dir, Path(self.run.dir).parent)

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], image: Path | None = None) -> None:
        import wandb

        payload = {f"{name}/table": wandb.Table(columns=columns, data=rows)}
        if image is not None:
            payload[f"{name}/plot"] = wandb.Image(str(image))
        self.run.log(payload)

    def log_summary(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))})

    def finish(self) -> None:
        self.run.finish()


class TensorBoardLogger(NullLogger):
    """TensorBoard event files in <run>/tensorboard under W&B's key names (train/loss, dev/ndcg@10, ...): the history
    as scalars at their step, the run's numeric summary (effective_batch_size, speedup, peak memory...) as scalars
    at the last step, the config as text."""

    def __init__(self, output_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir, self.last_step = output_dir / "tensorboard", 0
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1, default=str)}\n```")

    def truncate(self, step: int) -> None:
        # a resumed run logs the steps after `step` again: TensorBoard hides what was written from purge_step on
        self.writer.close()
        from torch.utils.tensorboard import SummaryWriter

        self.writer, self.last_step = SummaryWriter(log_dir=str(self.log_dir), purge_step=step + 1), step

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.last_step = max(self.last_step, step)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crashed or killed run keeps what it logged

    def log_table(self, name: str, columns: list[str], rows: list[list], image: Path | None = None) -> None:
        lines = [" | ".join(columns), " | ".join("---" for _ in columns), *(" | ".join(map(str, r)) for r in rows)]
        self.writer.add_text(f"{name}/table", "\n".join(lines), self.last_step)

    def log_summary(self, summary: dict) -> None:
        for key, value in summary.items():
            if isinstance(value, (int, float)) and math.isfinite(value):  # bools are ints: stopped_early 0/1
                self.writer.add_scalar(key, value, self.last_step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class Loggers(NullLogger):
    """Fans out to several loggers (metrics.csv is always kept beside W&B and TensorBoard)."""

    def __init__(self, loggers: list[NullLogger]):
        self.loggers = loggers

    def log_metrics(self, metrics: dict, step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def log_summary(self, summary: dict) -> None:
        for logger in self.loggers:
            logger.log_summary(summary)

    def truncate(self, step: int) -> None:
        for logger in self.loggers:
            logger.truncate(step)

    def log_table(self, name: str, columns: list[str], rows: list[list], image: Path | None = None) -> None:
        for logger in self.loggers:
            logger.log_table(name, columns, rows, image)

    def finish(self) -> None:
        for logger in self.loggers:
            logger.finish()


def make_logger(
    cfg: LoggerConfig,
    output_dir: Path,
    is_main: bool,
    name: str = "",
    group: str = "",
    job_type: str = "train",
    config: dict | None = None,
) -> NullLogger:
    if not is_main or cfg.name == "none":
        return NullLogger()
    loggers: list[NullLogger] = [CSVLogger(output_dir)]
    if cfg.name == "wandb" and wandb_mode(cfg) != "disabled":
        loggers.append(WandbLogger(cfg, output_dir, name, group, job_type, config or {}))
    if cfg.name == "tensorboard" or cfg.tensorboard:
        loggers.append(TensorBoardLogger(output_dir, config or {}))
    return Loggers(loggers)


def run_logger(cfg: RunConfig, output_dir: Path, is_main: bool, derived: dict) -> NullLogger:
    """The loggers of one training job: in a sweep, W&B groups the trials by study and names them by number."""
    trial = current_trial()
    in_sweep = trial is not None
    name = f"{trial.study_name}-trial{trial.number}" if in_sweep else output_dir.name
    return make_logger(
        cfg.logger,
        output_dir,
        is_main,
        name=name,
        group=trial.study_name if in_sweep else name,
        job_type="trial" if in_sweep else "train",
        config={**plain_dict(cfg), **derived, **({"trial": trial.record()} if in_sweep else {})},
    )
