"""GPU acceptance check: every GPU-only path of lychee_exp, run for real, and the LoRA recipe timed against HF
Trainer + peft, in one command within a time budget (benchmarks/gpu_check.sh; docs/gpu_check.md).

  bash benchmarks/gpu_check.sh [--out gpu_check.json] [--budget-s 330] [--hf-compile] [--ablation] [--tiny]

Checks, each in its own process so that one failure does not hide the others, in this order: the required ones
first, then the optional ones while the pace measured so far says they fit (a check that does not fit is
recorded as skipped; a required one skipped fails the check). Each prints its seconds as it ends.
  weights              the model drawn once from a seed (on the GPU) and written as safetensors: every later run
                       of both systems loads it, and records a fingerprint of what it loaded
  lora_1p5b_<len>      lychee_exp's LoRA r=64 recipe on a Qwen2.5-1.5B-shaped model (random weights, no
                       download), rows of exactly <len> tokens; >= 30 timed steps after warm-up
  hf_side_by_side      the same training in HF Trainer + peft, equal lengths (2048) and long-tailed (32-4096)
  gpu_tests            pytest -m gpu
  matmul_ceiling       (optional) bf16 8192^3 GEMM rate on random data (CUDA events), beside MFU
  ddp_cli / dp_cli     (optional) `python -m lychee_exp.run parallel=ddp|dp gpus=auto` end to end
  warm_sweep           (optional) a 2-trial sweep with parallel=ddp gpus=auto on warm ranks
  hf_compiled          (only with --hf-compile) HF with torch_compile=True on both mixes
--ablation runs instead one lychee_exp row per speed lever (benchmarks.gpu.timed_runs.ABLATION), budget 450 s.
--tiny (alias --dry-run) runs every phase on the CPU with the tiny Qwen2 and tiny mixes, a few steps each.
(--tiny --ablation runs its rows in one worker process: on a CPU a run's cost is mostly its imports.)
Writes one JSON (commit, device, per-check figures and pass/fail), whole, over an earlier report only (another file
with --overwrite), and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu import timed_runs as timed
from benchmarks.gpu.flops import bf16_peak_tflops
from lychee_exp.errors import command_main
from lychee_exp.io.outputs import POLICY_LINE, interrupted_line, staged_output

REPO = Path(__file__).resolve().parents[1]

TINY_RUN = [
    "model=tiny_lychee",
    "data.max_train_queries=16",
    "data.max_dev_queries=4",
    "data.batch_size=2",
    "data.train_group_size=4",
    "trainer.max_steps=6",
    "trainer.progress_bar=false",
    "logger=csv",
]
REQUIRED = ("weights", "lora_1p5b_512", "lora_1p5b_2048", "hf_side_by_side", "gpu_tests")  # skipped = failed
DEFAULT_BUDGET_S = {False: 330.0, True: 450.0}  # checks (ends within 6 minutes with start-up), --ablation (8)
NOT_RUN = {"skipped": "not run"}
GPU_TESTS_GUESS_S = {False: 80.0, True: 20.0}  # before it ran here: 74 s on the H200 on 2026-11-30 (GPU, --tiny)


def commit() -> str:
    """The commit checked: git's, with -dirty for local changes; else LYCHEE_COMMIT (the device machine gets the
    working tree without .git: the prepared command passes it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=REPO, capture_output=True, text=True)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("LYCHEE_COMMIT", "unknown")


def run_lychee(args: list[str], run_dir: Path, timeout_s: float) -> tuple[bool, dict, str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", HYDRA_FULL_ERROR="1")
    cmd = [sys.executable, "-m", "lychee_exp.run", *args, f"hydra.run.dir={run_dir}"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, {}, f"timed out after {timeout_s:.0f} s"
    metrics_file = run_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return proc.returncode == 0 and bool(metrics), metrics, tail


def check_gpu_tests(timeout_s: float, work: Path) -> dict:
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    # the tests' temporary files (their baseline cache, pytest's own) in the check's temporary directory: they go
    # with it, however the check ends
    scratch = work / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", TMPDIR=str(scratch))
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"timed out after {timeout_s:.0f} s"}
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    # exit 5: every test skipped (no CUDA: the dry run), which is what they must do there
    passed = proc.returncode == 0 or (proc.returncode == 5 and "skipped" in summary)
    tail = "" if passed else proc.stdout[-3000:] + proc.stderr[-1500:]
    return {"passed": passed, "files": files, "summary": summary, "tail": tail}


def check_cli(strategy: str, work: Path, timeout_s: float, cuda_count: int) -> dict:
    ok, metrics, tail = run_lychee(
        [*TINY_RUN, f"parallel={strategy}", "gpus=auto"], work / f"run_{strategy}", timeout_s
    )
    facts = {k: metrics.get(k) for k in ("num_devices", "backend", "device", "ndcg@10", "steps")}
    # one rank needs no process group: NCCL is exercised only with two or more GPUs
    expected_backend = "nccl" if strategy == "ddp" and cuda_count > 1 else "none"
    ok = ok and metrics.get("num_devices") == cuda_count and metrics.get("backend") == expected_backend
    return {"passed": ok, "nccl_exercised": expected_backend == "nccl", **facts, **({} if ok else {"tail": tail})}


def check_warm_sweep(work: Path, timeout_s: float) -> dict:
    """A 2-trial sweep on every visible GPU: trial 1 must run on the ranks trial 0 started (warm ranks)."""
    sweep = work / "warm_sweep"
    args = ["-m", "hparams_search=lr_batch", *TINY_RUN, "parallel=ddp", "gpus=auto", "trainer.measure_speedup=false"]
    args += ["hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep}"]
    ok, metrics, tail = run_lychee(args, sweep / "1", timeout_s)  # trial 1's metrics.json
    ok = ok and metrics.get("warm_ranks") is True
    facts = {k: metrics.get(k) for k in ("warm_ranks", "num_devices", "backend", "ndcg@10")}
    return {"passed": ok, **facts, **({} if ok else {"tail": tail})}


def plan(args, runner: timed.Runner, work: Path, cuda_count: int) -> list[tuple[str, str, object]]:
    """(name, pace kind, check) in the order they run; a check starts when a run of its kind fits."""
    budget = runner.budget
    weights = ("weights", "weights", runner.build_weights)
    matmul = ("matmul_ceiling", "matmul", lambda: runner.run("matmul"))
    if args.ablation:
        liger = importlib.util.find_spec("liger_kernel") is not None
        return [weights, ("ablation", "ours", lambda: timed.ablation(runner, liger)), matmul]
    lora = {}

    def lora_check(key: str):
        lora[key] = timed.lora_check(runner, key)
        return lora[key]

    def gpu_tests() -> dict:
        started = time.perf_counter()
        result = check_gpu_tests(budget.left - 5, work)
        runner.pace["gpu_tests"] = time.perf_counter() - started
        return result

    runner.guess["gpu_tests"] = GPU_TESTS_GUESS_S[args.tiny]
    steps = [
        weights,
        ("lora_1p5b_512", "ours", lambda: lora_check("lora_1p5b_512")),
        ("lora_1p5b_2048", "ours", lambda: lora_check("lora_1p5b_2048")),
        ("hf_side_by_side", "hf", lambda: timed.side_by_side(runner, lora.get("lora_1p5b_2048", NOT_RUN))),
        ("gpu_tests", "gpu_tests", gpu_tests),
        matmul,
    ]
    if not args.tiny:
        steps += [
            ("ddp_cli", "ours", lambda: check_cli("ddp", work, budget.left - 5, cuda_count)),
            ("dp_cli", "ours", lambda: check_cli("dp", work, budget.left - 5, cuda_count)),
            ("warm_sweep", "ours", lambda: check_warm_sweep(work, budget.left - 5)),
        ]
    if args.hf_compile:
        sbs = runner.results.get
        steps.append(("hf_compiled", "hf_compiled", lambda: timed.hf_compiled(runner, sbs("hf_side_by_side"))))
    return steps


def print_table(checks: dict) -> None:
    """The timed rows last (the device reply carries the end of the output): one line each."""
    rows = [(n, checks[n]) for n in ("lora_1p5b_512", "lora_1p5b_2048") if n in checks]
    for mix, entry in (checks.get("hf_side_by_side") or {}).items():
        if isinstance(entry, dict) and "rows" in entry:
            # equal lengths: lychee_exp's row is lora_1p5b_2048's run
            rows += [(f"{mix}/{k}", r) for k, r in entry["rows"].items() if k != "ours" or mix != "equal_lengths"]
            print(f"gpu_check: first losses, {mix}: lychee_exp {entry['first_losses']['ours']} | "
                  f"HF {entry['first_losses']['hf']}")  # fmt: skip
    rows += [(f"hf_compiled/{m}", r) for m, r in (checks.get("hf_compiled") or {}).get("rows", {}).items()]
    rows += [(f"ablation/{n}", r) for n, r in (checks.get("ablation") or {}).get("rows", {}).items()]
    for name, row in rows:
        if "attention" in row:
            print(f"gpu_check: {name}: attention {row['attention']} (seen: {row.get('attention_paths_seen')}), "
                  f"widths {row.get('widths_seen')}, checkpointing {row.get('checkpointing_why')}")  # fmt: skip
    head = f"{'run':34} {'tokens/s':>10} {'MFU':>7} {'HFU':>7} {'steps':>5} {'shapes':>6} {'pad':>5} {'peak MB':>9}"
    print(head + " ckpt  vs_defaults")
    for name, row in rows:
        if "tokens_per_s" not in row:
            print(f"{name:34} {(row.get('skipped') or row.get('error') or '')[:80]}")
            continue
        pct = lambda x: f"{100 * x:.1f}%" if x is not None else "-"  # noqa: E731
        print(f"{name:34} {row['tokens_per_s']:>10.0f} {pct(row['mfu']):>7} {pct(row['hardware_utilisation']):>7} "
              f"{row['timed_steps']:>5} {row['distinct_shapes']:>6} {row['padding_share']:>5.2f} "
              f"{row.get('peak_memory_mb') or 0:>9.0f} {row.get('gradient_checkpointing')!s:5} "
              f"{row.get('vs_defaults', '')}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0], epilog=POLICY_LINE
    )
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON report goes")
    parser.add_argument("--overwrite", action="store_true", help="replace an --out file that is not a gpu_check report")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole check ends within this (seconds; default 330, --ablation 450)")  # fmt: skip
    parser.add_argument("--timed", type=int, default=None, help="timed steps per run (default 30; --tiny: 2)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps before the clock (default 3; --tiny: 1)"
    )
    parser.add_argument("--ablation", action="store_true", help="one row per speed lever instead of the checks")
    parser.add_argument("--hf-compile", action="store_true", help="add HF's torch_compile=True rows (optional, last)")
    parser.add_argument("--tiny", "--dry-run", action="store_true", help="CPU, tiny model and mixes, a few steps")
    args = parser.parse_args()
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S[args.ablation]
    import torch

    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not cuda_count and not args.tiny:
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing to check "
              "(--tiny runs the same checks on the CPU)", file=sys.stderr)  # fmt: skip
        return 2
    # a user mistake, Ctrl-C or SIGTERM: one line (with this command's prefix), --out left as it was
    return command_main(lambda: check(args, cuda_count), lambda: interrupted_line(args.out), _say)


def _say(line: str) -> None:
    print(f"gpu_check: {line}", file=sys.stderr)


def check(args: argparse.Namespace, cuda_count: int) -> int:
    """Every check, then the report: --out is checked and locked before the first check, and written whole when
    the last one ended."""
    with staged_output(
        args.out,
        directory=False,
        overwrite=args.overwrite,
        inputs=(),
        key="--out",
        ours=_earlier_report,
        overwrite_flag="--overwrite",
    ) as staged:
        report = run_checks(args, cuda_count)
        staged.write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_check: {'all checks passed' if report['passed'] else 'FAILED'} in {report['seconds']} s "
          f"(budget {args.budget_s:.0f} s); report in {args.out}")  # fmt: skip
    return 0 if report["passed"] else 1


def _earlier_report(path: Path) -> bool:
    """Whether path holds a report of this command (replaced by a re-run without --overwrite)."""
    try:
        report = json.loads(path.read_text()) if path.stat().st_size < 2**26 else None
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"commit", "mode", "device", "checks"} <= report.keys()


def run_checks(args: argparse.Namespace, cuda_count: int) -> dict:
    """Every check in order, within the budget; the report (printed as a table too)."""
    import torch

    name = torch.cuda.get_device_name(0) if cuda_count else "cpu"
    timed_steps = args.timed or (2 if args.tiny else 30)
    warmup = args.warmup or (1 if args.tiny else 3)
    report: dict = {
        "commit": commit(),
        "mode": ("tiny " if args.tiny else "") + ("ablation" if args.ablation else "checks"),
        "device": name,
        "device_count": cuda_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bf16_peak_tflops": bf16_peak_tflops(name),
        "budget_s": args.budget_s,
        "warmup_steps": warmup,
        "timed_steps": timed_steps,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "checks": {},
    }
    started = time.perf_counter()
    budget = timed.Budget(args.budget_s)
    with contextlib.ExitStack() as stack:  # the served worker stopped, then the temporary files gone, however it ends
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lychee_gpu_check_")))
        # the CPU dry run of the ablation: its rows in one worker process (its cost there is the processes' start)
        one_process = args.tiny and args.ablation
        runner = stack.enter_context(
            contextlib.closing(timed.Runner(work, args.tiny, warmup, timed_steps, budget, one_process=one_process))
        )
        for check_name, kind, check in plan(args, runner, work, cuda_count):
            t0 = time.perf_counter()
            if runner.fingerprint is None and check_name != "weights" and kind in ("ours", "hf", "hf_compiled"):
                result = {"skipped": "no weights: the weights phase did not finish"}
            else:
                result = runner.fits(kind)
            if result is None:
                try:
                    result = check()
                except Exception as err:  # noqa: BLE001 - a broken check is a failed check, and the others still run
                    result = {"passed": False, "error": f"{type(err).__name__}: {err}"}
            if "skipped" in result:  # a required check that did not run fails the check; an optional one does not
                result["passed"] = False if check_name in REQUIRED else None
            result.setdefault("passed", "error" not in result)
            runner.results[check_name] = result
            result["seconds"] = round(time.perf_counter() - t0, 1)
            report["checks"][check_name] = result
            brief = {k: v for k, v in result.items() if k not in ("tail", "rows", "profile")}
            verdict = {True: "PASS", False: "FAIL", None: "SKIPPED"}[result["passed"]]
            print(f"gpu_check: {check_name}: {verdict} ({result['seconds']} s, {budget.left:.0f} s left) "
                  f"{json.dumps(brief)[:1500]}", flush=True)  # fmt: skip
            if result["passed"] is False and result.get("tail"):
                print(result["tail"], flush=True)
        profile = (report["checks"].get("ablation") or {}).get("profile")
        if profile and "share" in profile:
            print(f"gpu_check: profile of the defaults row ({profile['clock']}): shares {profile['share']}")
            for k in profile["top_kernels"][:8]:
                print(f"gpu_check:   {k['seconds']:>9.5f} s {k['calls']:>6} calls {k['category']:>11} {k['name'][:90]}")
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["passed"] = all(c["passed"] is not False for c in report["checks"].values())
    print_table(report["checks"])
    return report


if __name__ == "__main__":
    sys.exit(main())
