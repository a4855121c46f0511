"""Where lychee_exp's training step spends its time: torch.profiler over a short run, top operators by self time.

    python -m benchmarks.step_profile [--steps 8] [--fill-uninitialized-memory] [overrides]

The run is bench_peers' sample mix (the MiniLM cross-encoder on the sample set with the Lychee prompt, 8 queries x
4 documents = 32 pairs per step, fp32, dropout 0) on `parallel=single`, built in this process and profiled over
its whole fit (data loading and collation included). `--fill-uninitialized-memory` turns back on what
deterministic mode did before lychee_exp switched it off (every new tensor's memory filled), to see its cost.
Extra arguments are run overrides (e.g. `trainer.forward_chunks=4`, `model=tiny_lychee`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.peers import MIXES, SETTINGS
from lychee_exp.config.schema import to_run_config
from lychee_exp.job.in_process import compose_job
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps profiled")
    parser.add_argument("--rows", type=int, default=12, help="operators shown (by self CPU time)")
    parser.add_argument(
        "--fill-uninitialized-memory",
        action="store_true",
        help="fill every new tensor's memory, as deterministic mode did",
    )
    args, overrides = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="lychee-step-profile-"))
    run = [*SETTINGS, *MIXES["sample"], "parallel=single", "gpus=1", "data.batch_size=8", *overrides]
    run += [f"trainer.max_steps={args.steps}", "trainer.evaluate=false", "logger=none", "trainer.save_model=false"]
    cfg = to_run_config(compose_job([*run, "trainer.progress_bar=false", "trainer.measure_speedup=false"], out))
    plan = plan_devices("single", 1)
    torch.set_num_threads(plan.threads_per_rank)
    trainer = Trainer(cfg, DistEnv(), plan, out)
    trainer.setup()
    torch.utils.deterministic.fill_uninitialized_memory = args.fill_uninitialized_memory
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        summary = trainer.fit()
    trainer.cleanup()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    fill = sum(e.self_cpu_time_total for e in events if e.key in ("aten::fill_", "aten::zero_"))
    print(
        f"{summary['steps']} steps, {summary['train_tokens_per_s']:.0f} non-pad tokens/s, padding "
        f"{summary['padding_share']:.0%}; aten::fill_ + aten::zero_ {100 * fill / total:.1f}% of self CPU time "
        f"(fill_uninitialized_memory={args.fill_uninitialized_memory})"
    )


if __name__ == "__main__":
    main()
