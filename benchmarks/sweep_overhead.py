"""Per-trial overhead of a sweep, warm ranks against fresh ranks per trial, side by side; or warm ranks of this
tree against warm ranks of an earlier commit (`--against REF`), to find and check an overhead regression.

    python -m benchmarks.sweep_overhead [--trials 6] [--gpus 2] [--repeats 2] [--preset tiny|issue]
                                        [--devices-per-trial N] [--against REF] [--baselines FILE]
                                        [--out DIR [--overwrite]] [overrides]

Runs the same sweep (`hparams_search=lr_batch`, the tiny Qwen2, `parallel=ddp gpus=N`) once per kind, `--repeats`
times (at least 2), after one untimed sweep that fills their shared speedup-baseline cache (or with the cache
`--baselines` names), alternating which kind goes first so that cold caches and the first start-up fall on both
sides. Kinds: `fresh` and `warm` (`parallel.warm_ranks=false/true`); with `--against REF`, `warm@REF` (the
commit's code, exported with `git archive` and put first on PYTHONPATH) and `warm` (this tree). Presets: `tiny`
(16 train / 6 dev queries, metrics.csv only, no pruning) or `issue` (issue 25's sweep: `model=tiny_lychee
trainer.max_steps=4` with the default data, logger and pruner). `--devices-per-trial N`: the sweeps run in device
slots of N devices (hydra.sweeper.devices_per_trial), so the overhead is a slot's trial's. Prints each trial's
overhead from trials.csv (duration - training - evaluation), the medians over all repeats, and whether the first
two kinds' trials got the same metrics. Extra arguments are overrides for every sweep
(e.g. `model=minilm_cross_encoder`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from lychee_exp.errors import UserError
from lychee_exp.io.outputs import POLICY_LINE

TINY = [
    "model=tiny_lychee",
    "data.max_train_queries=16",
    "data.max_dev_queries=6",
    "data.train_group_size=4",
    "trainer.max_steps=4",
    "trainer.progress_bar=false",
    "trainer.precision=fp32",
    "trainer.save_model=false",
    "optimizer.lr_scaling=none",
    "logger=csv",
    "hydra.sweeper.pruner._target_=optuna.pruners.NopPruner",
    "~hydra.sweeper.pruner.n_startup_trials",
    "~hydra.sweeper.pruner.n_warmup_steps",
]
COMPARED = ("ndcg@10", "mrr@10", "train_loss", "steps")
# the names the benchmark writes into --out: an --out holding anything else is never replaced
WRITES = (r"baselines\.json", r"scaling\.json", "fill-baselines", r"\d+-.+", r"code-.+")


# issue 25's sweep: its overhead was 0.27 s a warm trial at the tiny preset, 1.2-1.6 s at this one
ISSUE = ["model=tiny_lychee", "trainer.max_steps=4", "trainer.progress_bar=false"]
PRESETS = {"tiny": TINY, "issue": ISSUE}


def sweep(sweep_dir: Path, trials: int, gpus: int, warm: bool, overrides: list[str], code: Path | None = None) -> float:
    """One sweep; `code`: a source tree to run instead of the installed lychee_exp (first on PYTHONPATH)."""
    command = [
        sys.executable,
        "-m",
        "lychee_exp.run",
        "-m",
        "hparams_search=lr_batch",
        "parallel=ddp",
        f"gpus={gpus}",
        f"parallel.warm_ranks={str(warm).lower()}",
        f"hydra.sweeper.n_trials={trials}",
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    ]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=code)
    if proc.returncode:
        sys.exit(f"the sweep in {sweep_dir} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return time.perf_counter() - start


def rows(sweep_dir: Path) -> list[dict]:
    with (sweep_dir / "trials.csv").open() as handle:
        return list(csv.DictReader(handle))


def outcome(run_dir: str) -> tuple:
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    return tuple(round(metrics[k], 6) for k in COMPARED)


def export(ref: str, out: Path) -> Path:
    """The tree of commit `ref` of this repository, in out/<ref>."""
    repo = Path(__file__).resolve().parents[1]
    target = out / f"code-{ref}"
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0], epilog=POLICY_LINE
    )
    parser.add_argument("--trials", type=int, default=6, help="trials per sweep")
    parser.add_argument("--gpus", type=int, default=2, help="ranks per trial (parallel=ddp gpus=N)")
    parser.add_argument("--repeats", type=int, default=2, help="sweeps per kind, order alternating (>= 2)")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="the sweep's model and data (see the docstring)"
    )
    parser.add_argument("--against", metavar="REF", help="warm ranks of this commit against this tree's")
    parser.add_argument("--baselines", type=Path, help="a filled baseline cache (baselines.json of an earlier --out)")
    parser.add_argument("--devices-per-trial", help="N devices per slot (trials at once); unset: the sweep's own")
    harness.add_output_options(parser, f"{tempfile.gettempdir()}/lychee-sweep-overhead/<time>")
    args, overrides = parser.parse_known_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: the order alternates between repeats")
    if args.out is None:
        args.out = harness.fresh_out("lychee-sweep-overhead", root=tempfile.gettempdir())
    inputs = [("--baselines", str(args.baselines))] if args.baselines else []
    return harness.bench_main(lambda: compare(args, overrides, inputs), args.out)


def compare(args: argparse.Namespace, overrides: list[str], inputs: list[tuple[str, str]]) -> None:
    if args.baselines and not args.baselines.is_file():
        raise UserError(f"--baselines={args.baselines}: no such file")
    with harness.bench_output(args.out, WRITES, args.overwrite, inputs) as staging:
        summary = measure(args, overrides, staging)
    print(f"{summary}; sweeps in {args.out}")


def measure(args: argparse.Namespace, overrides: list[str], out: Path) -> str:
    """Every sweep into out, the per-trial table printed; the summary line."""
    # one speedup-baseline cache for every sweep, filled by an untimed sweep first: the timed trials find their
    # baselines cached (a calibration would count as overhead on whichever kind met a batch size first)
    baselines = out / "baselines.json"
    if args.baselines:
        shutil.copyfile(args.baselines, baselines)
    os.environ["LYCHEE_BASELINE_FILE"] = str(baselines)  # the sweeps' subprocesses inherit it
    overrides = [*PRESETS[args.preset], *overrides]
    if args.devices_per_trial:  # only when asked: a commit older than slots (--against) has no such key
        overrides.append(f"hydra.sweeper.devices_per_trial={args.devices_per_trial}")
    if not args.baselines:
        sweep(out / "fill-baselines", args.trials, args.gpus, True, overrides)
    # (name, warm ranks, source tree or None for this one)
    kinds = [("fresh", False, None), ("warm", True, None)]
    if args.against:
        kinds = [(f"warm@{args.against}", True, export(args.against, out)), ("warm", True, None)]
    names = [name for name, _, _ in kinds]
    walls: dict[str, list[float]] = {name: [] for name in names}
    tables: dict[str, list[list[dict]]] = {name: [] for name in names}
    source = {name: (warm, code) for name, warm, code in kinds}
    for repeat in range(args.repeats):
        order = harness.turn_order(names, repeat)  # each kind first in turn
        for name in order:
            sweep_dir = out / f"{repeat}-{name.replace('@', '-')}"
            warm, code = source[name]
            walls[name].append(sweep(sweep_dir, args.trials, args.gpus, warm, overrides, code))
            tables[name].append(rows(sweep_dir))
        print(f"repeat {repeat}: {' then '.join(order)}")
    first, second = names
    columns = (
        ("rep", 3),
        ("trial", 5),
        (f"{first}: overhead s", 20),
        (f"{second}: overhead s", 20),
        ("train+eval s", 13),
    )
    print(" ".join(f"{name:>{width}}" for name, width in columns), "same metrics")
    same = []
    for repeat in range(args.repeats):
        for a, b in zip(tables[first][repeat], tables[second][repeat]):
            same.append(outcome(a["run_dir"]) == outcome(b["run_dir"]))
            work = float(b["train_time_s"]) + float(b["eval_time_s"])
            print(f"{repeat:>3} {a['number']:>5} {a['overhead_s']:>20} {b['overhead_s']:>20} {work:>13.2f} {same[-1]}")
    medians = {
        name: statistics.median(float(r["overhead_s"]) for table in per_repeat for r in table)
        for name, per_repeat in tables.items()
    }
    return (
        f"median overhead per trial over {args.repeats} repeats ({args.preset} preset, devices_per_trial="
        f"{args.devices_per_trial or 'all'}): {first} "
        f"{medians[first]:.2f} s, {second} {medians[second]:.2f} s ({medians[first] / medians[second]:.1f}x less); "
        f"median sweep wall time {statistics.median(walls[first]):.0f} s vs {statistics.median(walls[second]):.0f} s; "
        f"metrics equal in {sum(same)}/{len(same)} trials"
    )


if __name__ == "__main__":
    sys.exit(main())
