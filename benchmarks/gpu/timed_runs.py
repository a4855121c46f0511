"""The timed parts of benchmarks/gpu_check.py: each run a fresh worker process (benchmarks.gpu.worker) under
one time budget, so the whole check ends in time whatever a run costs. A run starts only when the pace measured so
far (the longest run of its kind, else of any kind, else a first guess) says it fits in what is left of the budget;
one that does not is recorded as skipped, with the reason, never left out silently.

Runs: the weights (drawn once, written as safetensors, loaded by every later run), lora_1p5b_512 and
lora_1p5b_2048 (lychee_exp's LoRA recipe on equal-length rows), the HF side by side (lychee_exp and HF Trainer +
peft on equal lengths ~2048 and on a long-tailed 32-4096 mix; HF with torch_compile=True only when asked), and
the ablation (one lever changed per row).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu.lychee_lora_run import has_key
from benchmarks.gpu.mixes import Mix, full_mixes, model_dir, tiny_mixes, write_mix
from benchmarks.gpu.worker import Served

REPO = Path(__file__).resolve().parents[2]
FIRST_GUESS_S = {False: 60.0, True: 10.0}  # a run's seconds before any was measured (GPU, --tiny)
TRAINING = ("ours", "hf", "hf_compiled")  # kinds whose runs cost about the same (one fresh training process)
PACE_MARGIN = 1.15  # the next run of a kind may take a little longer than the longest one so far
PROFILE_STEPS = 3  # torch.profiler over this many steps after the defaults row's window

# (row, mix, overrides), the most telling first so that a short window still answers the main questions: the
# defaults; the recipe as measured on the H200 on 2026-11-30 (full checkpointing, peft's float32 adapter path,
# unfused AdamW, tokenizing in the step, padded rows); then one lever changed per row. Each row is compared with
# the defaults row of its mix (`vs_defaults`). Rows whose key the config schema lacks are recorded as skipped.
BEFORE = ["model.gradient_checkpointing=true", "model.lora.dtype=float32", "optimizer.fused=false",
          "data.pretokenize=false", "data.packing=false", "data.max_tokens_per_batch=null"]  # fmt: skip
ABLATION = (
    ("defaults", "lora_1p5b_2048", []),
    ("before", "lora_1p5b_2048", BEFORE),
    ("gradient_checkpointing_on", "lora_1p5b_2048", ["model.gradient_checkpointing=true"]),
    ("lora_float32_path", "lora_1p5b_2048", ["model.lora.dtype=float32"]),
    ("compile_layers", "lora_1p5b_2048", ["model.compile_layers=true"]),
    ("liger_kernel", "lora_1p5b_2048", ["model.liger_kernel=true"]),
    ("not_deterministic", "lora_1p5b_2048", ["trainer.deterministic=false"]),
    ("lora_dropout_0", "lora_1p5b_2048", ["model.lora.dropout=0.0"]),
    ("defaults_512", "lora_1p5b_512", []),  # the mix's token budget (16384: 4 groups of 8 x 512 per step)
    ("token_budget_half", "lora_1p5b_512", ["data.max_tokens_per_batch=x0.5"]),  # xF: F x the mix's budget
    ("token_budget_double", "lora_1p5b_512", ["data.max_tokens_per_batch=x2"]),
    ("unfused_adamw", "lora_1p5b_2048", ["optimizer.fused=false"]),
    ("lora_bf16_weights", "lora_1p5b_2048", ["model.lora.dtype=model"]),
    ("tokenize_in_step", "lora_1p5b_2048", ["data.pretokenize=false"]),
    ("no_packing", "lora_1p5b_2048", ["data.packing=false"]),
)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.deadline - time.monotonic()


class Runner:
    """Starts workers in `work`, one at a time, within the budget, and keeps the pace they set."""

    def __init__(self, work: Path, tiny: bool, warmup: int, timed: int, budget: Budget, one_process: bool = False):
        self.work, self.tiny, self.warmup, self.timed, self.budget = work, tiny, warmup, timed, budget
        self.one_process = one_process  # every run in one served worker (only --tiny --ablation: worker.Served)
        self.served: Served | None = None
        self.mixes = tiny_mixes() if tiny else full_mixes()
        self.model_dir = model_dir(work, tiny)
        self.count = 0
        self.results: dict = {}  # finished checks by name (later checks annotate earlier ones)
        self.pace: dict[str, float] = {}  # the longest run so far, by kind ("ours", "hf", "weights", ...)
        self.fingerprint: str | None = None  # of the weights every run must start from (build_weights)
        self.guess: dict[str, float] = {}  # first guesses by kind, where FIRST_GUESS_S does not fit

    def estimate(self, kind: str) -> float:
        """Seconds the next run of `kind` should take: its kind's longest so far, else (a training run) the
        longest training run so far, else a first guess."""
        if kind in self.pace:
            return PACE_MARGIN * self.pace[kind]
        if kind in TRAINING:
            seen = [self.pace[k] for k in TRAINING if k in self.pace]
            if seen:
                return PACE_MARGIN * max(seen)
        return self.guess.get(kind, FIRST_GUESS_S[self.tiny])

    def fits(self, kind: str) -> dict | None:
        """None when a run of `kind` fits in what is left, else the `skipped` row that says why not."""
        need, left = self.estimate(kind), self.budget.left
        if need <= left:
            return None
        return {"skipped": f"time budget: {left:.0f} s left, the measured pace says this run needs ~{need:.0f} s"}

    def data(self, mix: Mix, warmup: int) -> Path:
        path = self.work / f"{mix.name}_{warmup}.jsonl"
        if not path.exists():
            write_mix(mix, 2 * warmup + self.timed, path)  # HF's warm-up slice may come after the window
        return path

    def build_weights(self) -> dict:
        row = self.run("weights")
        if "error" not in row and "skipped" not in row:
            self.fingerprint = row["weights_fingerprint"]
        return row

    def run(self, system: str, mix_key: str | None = None, **extra) -> dict:
        """One worker; {'skipped': why} when the measured pace says it no longer fits."""
        kind = f"{system}_compiled" if extra.get("compile") else system
        skipped = self.fits(kind)
        if skipped:
            return skipped
        spec: dict = {"system": system, "seed": 42, "model_dir": str(self.model_dir), **extra}
        if mix_key:
            mix = self.mixes[mix_key]
            warmup = extra.get("warmup", self.warmup)
            spec.update(data=str(self.data(mix, warmup)), mix=dataclasses.asdict(mix), warmup=warmup, timed=self.timed)
        self.count += 1
        spec_file, out_file = self.work / f"spec_{self.count}.json", self.work / f"out_{self.count}.json"
        spec_file.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        if self.tiny:
            env.setdefault("OMP_NUM_THREADS", "1")
        started = time.perf_counter()
        limit = self.budget.left - 5
        try:
            code, tail = self.worker(spec_file, out_file, env, limit)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {limit:.0f} s (the time budget)", "seconds": round(limit, 1)}
        seconds = time.perf_counter() - started
        self.pace[kind] = max(self.pace.get(kind, 0.0), seconds)
        row = json.loads(out_file.read_text()) if out_file.is_file() else {"error": f"no result; exit {code}"}
        row["seconds"] = round(seconds, 1)
        if "fingerprints" in row and self.fingerprint:
            row["same_weights"] = row["fingerprints"]["weights"] == self.fingerprint
        if "error" in row:
            row["tail"] = tail
        what = " ".join(str(x) for x in (system, mix_key, extra.get("overrides") or "") if x)
        print(f"gpu_check:   run {self.count} ({what}): {seconds:.1f} s, {self.budget.left:.0f} s left", flush=True)
        return row

    def worker(self, spec_file: Path, out_file: Path, env: dict, limit: float) -> tuple[int | None, str]:
        """(exit status, the output's last lines) of one run: a fresh process, or the served one."""
        if self.one_process:
            if self.served is None or self.served.proc.poll() is not None:  # (a new one after a timeout)
                self.served = Served(self.work, env, REPO)
            return self.served.run(spec_file, out_file, limit)
        cmd = [sys.executable, "-m", "benchmarks.gpu.worker", str(spec_file), str(out_file)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        return proc.returncode, "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])

    def close(self) -> None:
        if self.served is not None:
            self.served.close()


def ok(row: dict) -> bool:
    return "error" not in row and "skipped" not in row and row.get("same_weights", True)


def lora_check(runner: Runner, key: str) -> dict:
    """lychee_exp's recipe on equal-length rows; passes when it trained through its timed window from the
    check's weights."""
    row = runner.run("ours", key, packing="auto")
    return {"passed": ok(row) and row["timed_steps"] == runner.timed, **row}


def side_by_side(runner: Runner, ours_equal: dict) -> dict:
    """lychee_exp vs HF Trainer + peft, fresh processes, interleaved: equal lengths (lychee_exp's row is the
    lora_1p5b_2048 run, the same spec), then the long-tailed mix (lychee_exp: packing where the schema has it,
    else bucketing by length + forward chunks; HF: group_by_length within the warm-up and the window's rows).
    Passes when every row ran from the same weights and adapters and, on equal lengths, the first step's losses
    agree."""
    long_warmup = runner.warmup + (2 if not runner.tiny else 0)  # a few more shapes seen before the clock starts
    long_ours = ["data.bucket_by_length=true", "trainer.forward_chunks=4"]
    rows = {
        "equal_lengths": {"ours": ours_equal, "hf": runner.run("hf", "lora_1p5b_2048")},
        "long_tailed": {
            "ours": runner.run("ours", "long_tailed", packing="auto", overrides=long_ours, warmup=long_warmup),
            "hf": runner.run("hf", "long_tailed", group_by_length=True, warmup=long_warmup),
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
            "padding_share": {"ours": ours.get("padding_share"), "hf": hf.get("padding_share")},
            "real_tokens_per_step": {"ours": ours.get("real_tokens_per_step"), "hf": hf.get("real_tokens_per_step")},
            "gradient_checkpointing": {
                "ours": ours.get("gradient_checkpointing"),
                "hf": hf.get("gradient_checkpointing"),
            },  # fmt: skip
            "first_losses": {"ours": ours.get("first_losses"), "hf": hf.get("first_losses")},
            "rows": systems,
        }
        if both:  # the same weights (checked against the build) and the same LoRA init
            entry["same_adapters"] = ours["fingerprints"]["adapters"] == hf["fingerprints"]["adapters"]
            both = entry["same_adapters"]
        if mix == "equal_lengths" and both:
            # same batches, same weights, lora_B = 0 until the first update: the first step's loss must agree
            entry["first_loss_gap"] = round(abs(ours["first_losses"][0] - hf["first_losses"][0]), 5)
            both = entry["first_loss_gap"] < 1e-2
        result[mix] = entry
        result["passed"] = result["passed"] and both
    return result


def hf_compiled(runner: Runner, sbs: dict | None) -> dict:
    """HF Trainer with torch_compile=True on both mixes (--hf-compile only: optional rows, added to the side by
    side as hf_compiled_tokens_per_s and ratio_vs_hf_compiled)."""
    if runner.tiny:
        return {
            "skipped": "--tiny: inductor compiles for minutes on a CPU; the flag is TrainingArguments(torch_compile)"
        }
    rows = {
        "equal_lengths": runner.run("hf", "lora_1p5b_2048", compile=True),
        "long_tailed": runner.run("hf", "long_tailed", compile=True, group_by_length=True, warmup=runner.warmup + 2),
    }
    for mix, row in rows.items():
        entry = (sbs or {}).get(mix)
        if entry is not None and ok(row):
            entry["hf_compiled_tokens_per_s"] = row["tokens_per_s"]
            ours = entry.get("ours_tokens_per_s")
            entry["ratio_vs_hf_compiled"] = round(ours / row["tokens_per_s"], 3) if ours else None
    return {"passed": None if not all(ok(r) for r in rows.values()) else True, "rows": rows}


def ablation_skip(name: str, overrides: list[str], tiny: bool, liger: bool) -> str | None:
    if name == "liger_kernel" and not liger:
        return "liger_kernel is not installed (docs/gpu_check.md: carry its wheel)"
    if name == "liger_kernel" and tiny:
        return "--tiny: Liger's kernels are Triton kernels (CUDA only)"
    if name == "compile_layers" and tiny:
        return "--tiny: inductor compilation on the CPU is left to tests/test_levers.py"
    missing = [o.split("=")[0] for o in overrides if o.startswith("data.") and not has_key(o.split("=")[0][5:])]
    return f"this config schema has no {missing[0]}" if missing else None


def ablation(runner: Runner, liger: bool) -> dict:
    """One fresh process per row of ABLATION from the check's weights; tokens/s relative to the defaults row of
    the same mix; a torch.profiler summary of the defaults row's steps after its window."""
    rows: dict = {}
    for name, mix, overrides in ABLATION:
        # a reset to null of a key this tree's schema lacks is no change
        overrides = [o for o in overrides if not (o.endswith("=null") and not has_key(o.split("=")[0][5:]))]
        budget = runner.mixes[mix].token_budget
        overrides = [
            f"{o.split('=x')[0]}={int(budget * float(o.split('=x')[1]))}" if "=x" in o else o for o in overrides
        ]
        why = ablation_skip(name, overrides, runner.tiny, liger)
        if why:
            rows[name] = {"skipped": why}
            continue
        profile = PROFILE_STEPS if name == "defaults" else 0
        rows[name] = runner.run("ours", mix, overrides=overrides, packing="auto", profile_steps=profile)
        rows[name].update(mix=mix, ablation_overrides=overrides)
    for name, mix, _ in ABLATION:
        base = rows["defaults" if mix == "lora_1p5b_2048" else "defaults_512"].get("tokens_per_s")
        row = rows[name]
        if ok(row) and base:
            row["vs_defaults"] = round(row["tokens_per_s"] / base, 3)
    profile = rows["defaults"].get("profile")
    passed = all(ok(r) or "skipped" in r for r in rows.values()) and ok(rows["defaults"])
    return {"passed": passed, "profile": profile, "rows": rows}
