"""One system's timed run in a fresh process: `python -m lychee_exp.bench.gpu.worker SPEC.json OUT.json`.

SPEC: {"system": "ours" | "hf" | "weights" | "matmul", "model_dir", "data", "mix": {...}, "warmup", "timed", ...}.
OUT gets the row (or {"error": ...}); the exit status is 0 either way once OUT is written, so that the caller
reads one file.
"""

from __future__ import annotations

import json
import sys
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


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    work = out_path.parent / (out_path.stem + "_run")
    work.mkdir(parents=True, exist_ok=True)
    try:
        if spec["system"] == "ours":
            from lychee_exp.bench.gpu import lychee_lora_run

            row = lychee_lora_run.run(spec, work)
        elif spec["system"] == "hf":
            from lychee_exp.bench.gpu import hf_peft_run

            row = hf_peft_run.run(spec, work)
        elif spec["system"] == "weights":
            from lychee_exp.bench.gpu import weights

            row = weights.build(Path(spec["model_dir"]), spec["seed"])
        else:
            row = matmul_ceiling()
    except Exception as err:  # noqa: BLE001 - the caller reports the failure in the JSON
        traceback.print_exc()
        row = {"error": f"{type(err).__name__}: {err}"[:2000]}
    out_path.write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
