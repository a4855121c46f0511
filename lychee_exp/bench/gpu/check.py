"""The timed parts of launch/gpu_check.py: each run a fresh worker process (lychee_exp.bench.gpu.worker) under
one time budget, so the whole check ends in time whatever a run costs: a run that no longer fits is recorded as
skipped, with the reason, never left out silently.

Runs: lora_1p5b_512 and lora_1p5b_2048 (lychee_exp's LoRA recipe on equal-length rows), the HF side by side
(lychee_exp and HF Trainer + peft, interleaved, on equal lengths ~2048 and on a long-tailed 32-4096 mix; then
HF with torch_compile=True where time is left), and the ablation (one lever changed per row).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lychee_exp.bench.gpu.mixes import Mix, full_mixes, model_dir, tiny_mixes, write_mix
from lychee_exp.bench.gpu.ours import has_packing

REPO = Path(__file__).resolve().parents[3]

# One lever changed per row, from the defaults the recipe has now; "before" is the recipe as it was measured on
# the H200 on 2026-11-30 (full checkpointing, peft's float32 adapter path, unfused AdamW, tokenizing in the step).
ABLATION = {
    "defaults": [],
    "before": [
        "model.gradient_checkpointing=true",
        "model.lora.dtype=float32",
        "optimizer.fused=false",
        "data.pretokenize=false",
    ],
    "gradient_checkpointing_on": ["model.gradient_checkpointing=true"],
    "lora_float32_path": ["model.lora.dtype=float32"],
    "lora_bf16_weights": ["model.lora.dtype=model"],
    "unfused_adamw": ["optimizer.fused=false"],
    "compile_layers": ["model.compile_layers=true"],
    "liger_kernel": ["model.liger_kernel=true"],
    "lora_dropout_0": ["model.lora.dropout=0.0"],
    "not_deterministic": ["trainer.deterministic=false"],
    "tokenize_in_step": ["data.pretokenize=false"],
    "no_packing": ["data.packing=false"],  # where the schema has data.packing (every lychee_exp run packs then)
}


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.deadline - time.monotonic()


class Runner:
    """Starts workers in `work`, one at a time, within the budget."""

    def __init__(self, work: Path, tiny: bool, warmup: int, timed: int, budget: Budget):
        self.work, self.tiny, self.warmup, self.timed, self.budget = work, tiny, warmup, timed, budget
        self.mixes = tiny_mixes() if tiny else full_mixes()
        self.model_dir = model_dir(work, tiny)
        self.count = 0
        self.results: dict = {}  # finished checks by name (later checks annotate earlier ones)

    def data(self, mix: Mix, warmup: int) -> Path:
        path = self.work / f"{mix.name}.jsonl"
        if not path.exists():
            write_mix(mix, warmup + self.timed, path)
        return path

    def run(self, system: str, mix_key: str | None = None, min_s: float = 30, **extra) -> dict:
        """One worker; {'skipped': why} when less than min_s of the budget is left."""
        left = self.budget.left
        if left < min_s:
            return {"skipped": f"time budget: {left:.0f} s left, this run needs about {min_s:.0f} s"}
        spec: dict = {"system": system, "seed": 42, **extra}
        if mix_key:
            mix = self.mixes[mix_key]
            warmup = extra.get("warmup", self.warmup)
            spec.update(model_dir=str(self.model_dir), data=str(self.data(mix, warmup)), mix=dataclasses.asdict(mix))
            spec.update(warmup=warmup, timed=self.timed)
        self.count += 1
        spec_file, out_file = self.work / f"spec_{self.count}.json", self.work / f"out_{self.count}.json"
        spec_file.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        if self.tiny:
            env.setdefault("OMP_NUM_THREADS", "1")
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "lychee_exp.bench.gpu.worker", str(spec_file), str(out_file)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=left - 5)
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {left - 5:.0f} s (the time budget)", "seconds": round(left - 5, 1)}
        row = (
            json.loads(out_file.read_text()) if out_file.is_file() else {"error": f"no result; exit {proc.returncode}"}
        )
        row["seconds"] = round(time.perf_counter() - started, 1)
        if "error" in row:
            row["tail"] = tail
        return row


def ok(row: dict) -> bool:
    return "error" not in row and "skipped" not in row


def lora_check(runner: Runner, key: str) -> dict:
    """lychee_exp's recipe on equal-length rows; passes when it trained through its timed window."""
    row = runner.run("ours", key, min_s=45 if not runner.tiny else 5, packing="auto")
    return {"passed": ok(row) and row["timed_steps"] == runner.timed, **row}


def side_by_side(runner: Runner, ours_equal: dict) -> dict:
    """lychee_exp vs HF Trainer + peft, fresh processes, interleaved: equal lengths (lychee_exp's row is the
    lora_1p5b_2048 run, the same spec), then the long-tailed mix (lychee_exp: packing where the schema has it,
    else bucketing by length + forward chunks; HF: group_by_length). Passes when every row ran and, on equal
    lengths, the first step's losses agree."""
    min_s = 45 if not runner.tiny else 5
    long_warmup = runner.warmup + (2 if not runner.tiny else 0)  # a few more shapes seen before the clock starts
    long_ours = ["data.bucket_by_length=true", "trainer.forward_chunks=4"]
    rows = {
        "equal_lengths": {"ours": ours_equal, "hf": runner.run("hf", "lora_1p5b_2048", min_s)},
        "long_tailed": {
            "ours": runner.run("ours", "long_tailed", min_s, packing="auto", overrides=long_ours, warmup=long_warmup),
            "hf": runner.run("hf", "long_tailed", min_s, group_by_length=True, warmup=long_warmup),
        },
    }
    result: dict = {"passed": True}
    for mix, systems in rows.items():
        ours, hf = systems["ours"], systems["hf"]
        both = ok(ours) and ok(hf)
        entry = {
            "ours_tokens_per_s": ours.get("tokens_per_s"),
            "hf_tokens_per_s": hf.get("tokens_per_s"),
            "ratio": round(ours["tokens_per_s"] / hf["tokens_per_s"], 3) if both else None,
            "first_losses": {"ours": ours.get("first_losses"), "hf": hf.get("first_losses")},
            "rows": systems,
        }
        if mix == "equal_lengths" and both:
            # same batches, same weights, lora_B = 0 until the first update: the first step's loss must agree
            entry["first_loss_gap"] = round(abs(ours["first_losses"][0] - hf["first_losses"][0]), 5)
            both = entry["first_loss_gap"] < 1e-2
        result[mix] = entry
        result["passed"] = result["passed"] and both
    return result


def hf_compiled(runner: Runner, sbs: dict | None) -> dict:
    """HF Trainer with torch_compile=True on both mixes ("if it runs": optional rows, added to the side by side
    as hf_compiled_tokens_per_s and ratio_vs_hf_compiled)."""
    if runner.tiny:
        return {
            "skipped": "--tiny: inductor compiles for minutes on a CPU; the flag is TrainingArguments(torch_compile)"
        }
    long_warmup = runner.warmup + 2
    rows = {
        "equal_lengths": runner.run("hf", "lora_1p5b_2048", 90 if not runner.tiny else 5, compile=True),
        "long_tailed": runner.run(
            "hf", "long_tailed", 90 if not runner.tiny else 5, compile=True, group_by_length=True, warmup=long_warmup
        ),
    }
    for mix, row in rows.items():
        entry = (sbs or {}).get(mix)
        if entry is not None and ok(row):
            entry["hf_compiled_tokens_per_s"] = row["tokens_per_s"]
            ours = entry.get("ours_tokens_per_s")
            entry["ratio_vs_hf_compiled"] = round(ours / row["tokens_per_s"], 3) if ours else None
    return {"passed": None if not all(ok(r) for r in rows.values()) else True, "rows": rows}


def ablation(runner: Runner, liger: bool) -> dict:
    """lora_1p5b_2048 once per row of ABLATION, each a fresh process; tokens/s relative to the defaults row."""
    rows: dict = {}
    for name, overrides in ABLATION.items():
        if name == "liger_kernel" and not liger:
            rows[name] = {"skipped": "liger_kernel is not installed (docs/gpu_check.md: carry its wheel)"}
            continue
        if name == "no_packing" and not has_packing():
            rows[name] = {"skipped": "this config schema has no data.packing"}
            continue
        if name == "compile_layers" and runner.tiny:
            rows[name] = {"skipped": "--tiny: inductor compilation on the CPU is left to tests/test_levers.py"}
            continue
        if name == "before" and has_packing():
            overrides = [*overrides, "data.packing=false"]  # padded rows, as then
        min_s = 45 if not runner.tiny else 5
        rows[name] = runner.run("ours", "lora_1p5b_2048", min_s, overrides=overrides, packing="auto")
    base = rows["defaults"].get("tokens_per_s")
    for row in rows.values():
        if ok(row) and base:
            row["vs_defaults"] = round(row["tokens_per_s"] / base, 3)
    return {"passed": all(ok(r) or "skipped" in r for r in rows.values()) and ok(rows["defaults"]), "rows": rows}
