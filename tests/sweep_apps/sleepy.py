"""A plain Hydra app that sleeps and records when it ran: `stamps.json` (start, end: time.time(), and the cores
and CUDA_VISIBLE_DEVICES it got) in its output dir, for the tests of trials in flight. Job 0 sleeps `first_s`,
the others `sleep_s`; returns x, or raises after its sleep when `fail` is true. A sleep ends early once every file
in `until` exists (paths in the sweep dir: `<n>/started` is written as trial n starts, `<n>/stamps.json` as it
ends, others by the test): trials that wait for each other show overlap without betting on process start times."""

import json
import os
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="sleepy")
def sleepy(cfg: DictConfig) -> float:
    start = time.time()
    job = HydraConfig.get().job.num
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "started").touch()
    _sleep(cfg.first_s if job == 0 and cfg.first_s is not None else cfg.sleep_s, [out.parent / f for f in cfg.until])
    stamps = {"job": job, "pid": os.getpid(), "start": start, "end": time.time()}
    # the devices this job was given (hydra.sweeper.devices_per_trial: each slot its own)
    stamps.update(cores=sorted(os.sched_getaffinity(0)), cuda=os.environ.get("CUDA_VISIBLE_DEVICES"))
    (out / "stamps.json.tmp").write_text(json.dumps(stamps))
    (out / "stamps.json.tmp").rename(out / "stamps.json")  # whole, for a trial that waits for it
    if cfg.fail:
        raise RuntimeError(f"job {job} fails on purpose")
    return float(cfg.x)


def _sleep(seconds: float, until: list[Path]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until and all(path.exists() for path in until)):
        time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))


if __name__ == "__main__":
    sleepy()
