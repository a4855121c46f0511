"""One system's timed run in a fresh process: `python -m benchmarks.gpu.worker SPEC.json OUT.json`.

SPEC: {"system": "ours" | "hf" | "weights" | "matmul", "model_dir", "data", "mix": {...}, "warmup", "timed", ...}.
OUT gets the row (or {"error": ...}); the exit status is 0 either way once OUT is written, so that the caller
reads one file. `--serve` (Served) runs one "SPEC<TAB>OUT" line of stdin after another in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path


def matmul_ceiling(size: int = 8192, repeats: int = 20) -> dict:
    """bf16 GEMM rate on random data (three input sets in turn, so the L2 cache does not serve them), timed with
    CUDA events after a warm-up; the median. The measured ceiling that MFU can be read against."""
    import statistics

    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    sets = [(torch.randn(size, size, device="cuda", dtype=torch.bfloat16),) * 2 for _ in range(3)]
    out = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    for a, b in sets:
        torch.matmul(a, b, out=out)
    times = []
    for i in range(repeats):
        a, b = sets[i % 3]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    seconds = statistics.median(times)
    return {"bf16_matmul_tflops": round(2 * size**3 / seconds / 1e12, 1), "size": size, "repeats": repeats}


class Served:
    """One `--serve` worker that runs every run given to it, one after another: only for the CPU dry run of the
    ablation (gpu_check --tiny --ablation), whose cost is otherwise each fresh process's imports. The GPU check,
    and the --tiny check of every phase, keep a fresh process per run."""

    def __init__(self, work: Path, env: dict, repo: Path):
        self.log = work / "served_worker.log"
        cmd = [sys.executable, "-m", "benchmarks.gpu.worker", "--serve"]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=repo, env=env, stdin=subprocess.PIPE, stdout=log, stderr=log, text=True
            )

    def run(self, spec_file: Path, out_file: Path, timeout_s: float) -> tuple[int | None, str]:
        """(the worker's exit status if it died, else None; the last lines it printed for this run); raises
        subprocess.TimeoutExpired, the worker killed, when OUT is not written within timeout_s."""
        start, deadline = self.log.stat().st_size, time.monotonic() + timeout_s
        self.proc.stdin.write(f"{spec_file}\t{out_file}\n")
        self.proc.stdin.flush()
        while not out_file.exists() and self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                raise subprocess.TimeoutExpired(self.proc.args, timeout_s)
            time.sleep(0.05)
        with self.log.open() as log:
            log.seek(start)
            return self.proc.poll(), "\n".join(log.read().strip().splitlines()[-12:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the serve loop ends at the end of its input
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve() -> int:
    for line in sys.stdin:
        spec, out = line.rstrip("\n").split("\t")
        part = Path(out).with_suffix(".part")  # OUT appears whole: the caller waits for it to exist
        main([spec, str(part)])
        os.replace(part, out)
    return 0


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    work = out_path.parent / (out_path.stem + "_run")
    work.mkdir(parents=True, exist_ok=True)
    try:
        if spec["system"] == "ours":
            from benchmarks.gpu import lychee_lora_run

            row = lychee_lora_run.run(spec, work)
        elif spec["system"] == "hf":
            from benchmarks.gpu import hf_peft_run

            row = hf_peft_run.run(spec, work)
        elif spec["system"] == "weights":
            from benchmarks.gpu import weights

            row = weights.build(Path(spec["model_dir"]), spec["seed"])
        else:
            row = matmul_ceiling()
    except Exception as err:  # noqa: BLE001 - the caller reports the failure in the JSON
        traceback.print_exc()
        row = {"error": f"{type(err).__name__}: {err}"[:2000]}
    out_path.write_text(json.dumps(row, indent=2) + "\n")
    return 0


def parse_args(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description=__doc__.split("\n\n")[0].split(": `")[0] + " (benchmarks.gpu.timed_runs starts it).",
    )
    parser.add_argument("spec", nargs="?", metavar="SPEC.json", help="the run: system, model_dir, data, mix, ...")
    parser.add_argument("out", nargs="?", metavar="OUT.json", help='where the row (or {"error": ...}) is written')
    parser.add_argument("--serve", action="store_true", help='run "SPEC<TAB>OUT" lines of stdin one after another')
    args = parser.parse_args(argv)
    if not args.serve and args.out is None:
        parser.error("SPEC.json and OUT.json are required (or --serve)")
    return args


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    sys.exit(serve() if args.serve else main([args.spec, args.out]))
