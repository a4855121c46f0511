"""A plain Hydra app that sleeps and records when it ran: `stamps.json` (start, end: time.time(), and the cores
and CUDA_VISIBLE_DEVICES it got) in its output dir, for the tests of trials in flight. Job 0 sleeps `first_s`,
the others `sleep_s`; returns x, or raises after its sleep when `fail` is true."""

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
    time.sleep(cfg.first_s if job == 0 and cfg.first_s is not None else cfg.sleep_s)
    stamps = {"job": job, "pid": os.getpid(), "start": start, "end": time.time()}
    # the devices this job was given (hydra.sweeper.devices_per_trial: each slot its own)
    stamps.update(cores=sorted(os.sched_getaffinity(0)), cuda=os.environ.get("CUDA_VISIBLE_DEVICES"))
    (Path(HydraConfig.get().runtime.output_dir) / "stamps.json").write_text(json.dumps(stamps))
    if cfg.fail:
        raise RuntimeError(f"job {job} fails on purpose")
    return float(cfg.x)


if __name__ == "__main__":
    sleepy()
