"""GPU acceptance check: every GPU-only path of lychee_exp, run for real, in one command (launch/gpu_check.sh).

  bash launch/gpu_check.sh [--out gpu_check.json] [--steps 8]

Checks, each a separate process so that one failure does not hide the others:
  gpu_tests        pytest -m gpu (bf16/fp16 autocast, NCCL DDP, DataParallel on the tiny model)
  lora_1p5b_<len>  bf16 LoRA r=64 + gradient checkpointing on a Qwen2.5-1.5B-shaped model with random weights
                   (built from a config: no download) at <len> tokens per sequence; tokens/s, MFU, peak memory
  ddp_cli / dp_cli `python -m lychee_exp.run parallel=ddp|dp gpus=auto` end to end on every visible GPU
  warm_sweep       a 2-trial sweep with parallel=ddp gpus=auto: the second trial on the first one's warm ranks
Writes one JSON (device, per-check pass/fail and figures) and exits 1 if any check failed.

MFU counts model FLOPs, not hardware FLOPs: with LoRA the frozen weights get no weight gradients, so a token
costs 2N (forward) + 2N (backward through activations) FLOPs for the N non-embedding weights, plus attention
(4·layers·hidden·seq forward, twice that backward); recomputation by gradient checkpointing is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY_QWEN2 = REPO / "lychee_exp" / "assets" / "tiny_qwen2"
SAMPLE_TRAIN = REPO / "lychee_exp" / "assets" / "sample" / "train.jsonl"

# Qwen2.5-1.5B-Instruct's architecture (its config.json), with the tiny tokenizer: token ids stay below vocab_size.
QWEN25_1P5B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "pad_token_id": 0,
    "eos_token_id": 0,
}

# Dense bf16 tensor-core peak (vendor spec sheets, no sparsity), by a substring of the device name.
BF16_PEAK_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
    "A10G": 125.0,
    "RTX 4090": 165.2,
    "V100": 0.0,
}

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


def bf16_peak_tflops(name: str) -> float | None:
    for key, peak in BF16_PEAK_TFLOPS.items():
        if key in name:
            return peak or None
    return None


def model_flops_per_token(seq_len: int) -> float:
    c = QWEN25_1P5B
    d, layers, ffn = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    kv = d * c["num_key_value_heads"] // c["num_attention_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ffn  # q, o; k, v; gate, up, down
    n_non_embedding = layers * per_layer
    attention = 4 * layers * d * seq_len  # QK^T and AV, forward
    return 2 * n_non_embedding + attention + 2 * n_non_embedding + 2 * attention  # forward + activation backward


def write_long_data(path: Path, words_per_doc: int, queries: int = 24) -> None:
    """Sample queries with documents padded (by repeating real text) to at least words_per_doc words."""
    lines = SAMPLE_TRAIN.read_text().splitlines()[:queries]
    with path.open("w") as out:
        for line in lines:
            row = json.loads(line)

            def stretch(text: str) -> str:
                words = text.split() or ["text"]
                return " ".join((words * (words_per_doc // len(words) + 1))[:words_per_doc])

            row["pos"] = [stretch(t) for t in row["pos"]]
            row["neg"] = [stretch(t) for t in row["neg"]]
            out.write(json.dumps(row) + "\n")


def run_lychee(args: list[str], run_dir: Path, timeout_s: int) -> tuple[bool, dict, str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", HYDRA_FULL_ERROR="1")
    cmd = [sys.executable, "-m", "lychee_exp.run", *args, f"hydra.run.dir={run_dir}"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, {}, f"timed out after {timeout_s} s"
    metrics_file = run_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return proc.returncode == 0 and bool(metrics), metrics, tail


def check_gpu_tests() -> dict:
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    return {
        "passed": proc.returncode == 0,
        "files": files,
        "summary": summary,
        "tail": "" if proc.returncode == 0 else proc.stdout[-3000:] + proc.stderr[-1500:],
    }


def check_lora(seq_len: int, steps: int, work: Path, peak_tflops: float | None) -> dict:
    model_dir = work / "qwen25_1p5b_shape"
    if not model_dir.exists():
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(QWEN25_1P5B, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_QWEN2 / name, model_dir / name)
    data = work / f"long_{seq_len}.jsonl"
    write_long_data(data, words_per_doc=seq_len)  # the tiny BPE gives >= 1 token per word: documents hit the cap
    per_step_sequences = 16 if seq_len <= 512 else 4
    group = 8 if seq_len <= 512 else 4
    overrides = [
        "experiment=lychee_lora",
        f"model.path={model_dir}",
        "model.random_init=true",
        "parallel=single",
        "gpus=1",
        "data=jsonl",
        f"data.train_file={data}",
        f"data.dev_file={data}",
        "data.max_dev_queries=4",
        f"data.batch_size={per_step_sequences // group}",
        f"data.train_group_size={group}",
        "data.eval_batch_size=8",
        "model.prompt.query_max_len=32",
        f"model.prompt.doc_max_len={seq_len - 96}",
        "trainer.precision=bf16",
        f"trainer.max_steps={steps}",
        "trainer.eval_before_training=false",
        "trainer.save_model=false",
        "trainer.progress_bar=false",
        "trainer.log_every=1",
        "logger=csv",
        "speedup.calibrate=false",
    ]
    ok, metrics, tail = run_lychee(overrides, work / f"run_lora_{seq_len}", timeout_s=420)
    result = {"passed": ok, "seq_len_cap": seq_len, "sequences_per_step": per_step_sequences}
    if not ok:
        return {**result, "tail": tail}
    tokens_per_s = metrics["train_tokens_per_s"]
    achieved = tokens_per_s * model_flops_per_token(seq_len) / 1e12
    result.update(
        {
            "tokens_per_s": round(tokens_per_s, 1),
            "sequences_per_s": round(metrics["train_samples_per_s"] * group, 2),
            "model_tflops": round(achieved, 1),
            "mfu": round(achieved / peak_tflops, 4) if peak_tflops else None,
            "peak_memory_mb": round(max(metrics["peak_memory_mb_per_rank"]), 1),
            "data_wait_share": round(metrics["data_wait_share"], 4),
            "train_loss": metrics.get("train_loss"),
            "steps": metrics.get("steps"),
            "precision": metrics.get("precision"),
        }
    )
    return result


def check_cli(strategy: str, work: Path) -> dict:
    ok, metrics, tail = run_lychee([*TINY_RUN, f"parallel={strategy}", "gpus=auto"], work / f"run_{strategy}", 300)
    count = torch.cuda.device_count()
    facts = {k: metrics.get(k) for k in ("num_devices", "backend", "device", "ndcg@10", "steps")}
    # one rank needs no process group: NCCL is exercised only with two or more GPUs
    expected_backend = "nccl" if strategy == "ddp" and count > 1 else "none"
    ok = ok and metrics.get("num_devices") == count and metrics.get("backend") == expected_backend
    return {"passed": ok, "nccl_exercised": expected_backend == "nccl", **facts, **({} if ok else {"tail": tail})}


def check_warm_sweep(work: Path) -> dict:
    """A 2-trial sweep on every visible GPU: trial 1 must run on the ranks trial 0 started (warm ranks)."""
    sweep = work / "warm_sweep"
    args = ["-m", "hparams_search=lr_batch", *TINY_RUN, "parallel=ddp", "gpus=auto", "speedup.calibrate=false"]
    args += ["hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep}"]
    ok, metrics, tail = run_lychee(args, sweep / "1", 300)  # trial 1's metrics.json
    ok = ok and metrics.get("warm_ranks") is True
    facts = {k: metrics.get(k) for k in ("warm_ranks", "num_devices", "backend", "ndcg@10")}
    return {"passed": ok, **facts, **({} if ok else {"tail": tail})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON report goes")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per LoRA run (2 are warm-up)")
    parser.add_argument("--seq-lens", default="512,2048")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing to check", file=sys.stderr
        )
        return 2
    name = torch.cuda.get_device_name(0)
    peak = bf16_peak_tflops(name)
    report: dict = {
        "device": name,
        "device_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bf16_peak_tflops": peak,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "checks": {},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lychee_gpu_check_") as tmp:
        work = Path(tmp)
        steps = [("gpu_tests", check_gpu_tests)]
        steps += [
            (f"lora_1p5b_{n}", lambda n=int(n): check_lora(n, args.steps, work, peak)) for n in args.seq_lens.split(",")
        ]
        steps += [("ddp_cli", lambda: check_cli("ddp", work)), ("dp_cli", lambda: check_cli("dp", work))]
        steps += [("warm_sweep", lambda: check_warm_sweep(work))]
        for check_name, check in steps:
            t0 = time.perf_counter()
            try:
                result = check()
            except Exception as err:  # noqa: BLE001 - a broken check is a failed check, and the others still run
                result = {"passed": False, "error": f"{type(err).__name__}: {err}"}
            result["seconds"] = round(time.perf_counter() - t0, 1)
            report["checks"][check_name] = result
            print(
                f"gpu_check: {check_name}: {'PASS' if result['passed'] else 'FAIL'} "
                f"({result['seconds']} s) {json.dumps({k: v for k, v in result.items() if k != 'tail'})}",
                flush=True,
            )
            if not result["passed"] and result.get("tail"):
                print(result["tail"], flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["passed"] = all(c["passed"] for c in report["checks"].values())
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"gpu_check: {'all checks passed' if report['passed'] else 'FAILED'} in {report['seconds']} s; "
        f"report in {args.out}"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
