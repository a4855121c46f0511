"""Size and write time of a training checkpoint of Lychee Rerank (Qwen2.5-1.5B), LoRA r=64 vs full weights.

    python -m benchmarks.checkpoint_write [--dir /path/on/the/shared/filesystem] [--full] [--step-s 1.32]

Builds tensors shaped as the real trainable parameters and AdamW states (no model download) and writes them with
lychee_exp.train.checkpoint.save_checkpoint (safetensors weights + state.pt, fsync, atomic rename), as rank 0 does.
LoRA adapters are float32 (peft's default); full fine-tuning keeps the model's bfloat16 (weights and Adam state).
--full writes the ~9 GB full-weight checkpoint too (needs that much free disk and memory). Each line ends with the
interval trainer.checkpoint_every=auto would take for that write at steps of --step-s seconds (default: the LoRA
recipe's 16k-token step on an H100, 12,385 tokens/s in docs/gpu_check.md).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

# Qwen2.5-1.5B: hidden 1536, MLP 8960, 28 layers, 2 KV heads of 128 (k/v project to 256), vocab 151936
HIDDEN, MLP, LAYERS, KV, VOCAB = 1536, 8960, 28, 256, 151936
PROJ = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV),
    "v_proj": (HIDDEN, KV),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, MLP),
    "up_proj": (HIDDEN, MLP),
    "down_proj": (MLP, HIDDEN),
}


def lora_shapes(r: int = 64) -> dict[str, tuple[int, int]]:
    return {
        f"l{i}.{name}.lora_{ab}": shape
        for i in range(LAYERS)
        for name, (din, dout) in PROJ.items()
        for ab, shape in (("A", (r, din)), ("B", (dout, r)))
    }


def full_shapes() -> dict[str, tuple[int, int]]:
    shapes = {f"l{i}.{name}": (dout, din) for i in range(LAYERS) for name, (din, dout) in PROJ.items()}
    return {**shapes, "embed_tokens": (VOCAB, HIDDEN)}  # tied with the LM head in Qwen2.5-1.5B


class _Params(torch.nn.Module):
    def __init__(self, shapes: dict, dtype: torch.dtype):
        super().__init__()
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for k, s in shapes.items()}
        )


def measure(name: str, shapes: dict, dtype: torch.dtype, root: Path, step_s: float) -> None:
    from lychee_exp.train.checkpoint import save_checkpoint
    from lychee_exp.train.checkpoint_schedule import measured_interval

    model = _Params(shapes, dtype)
    adam = {
        i: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(1.0)}
        for i, p in enumerate(model.parameters())
    }
    state = {"optimizer": {"state": adam, "param_groups": [{"params": list(adam)}]}, "step": 1}
    count = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    path = save_checkpoint(root, 1, model, state, keep=1)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.iterdir())
    print(
        f"{name:>6}: {count / 1e6:8.1f}M trainable params ({dtype}), checkpoint {size / 1e9:6.2f} GB, "
        f"written in {seconds:5.1f} s ({size / 1e9 / seconds:.2f} GB/s); checkpoint_every=auto at {step_s:g} s "
        f"steps: every {measured_interval(seconds, step_s)} steps",
        flush=True,
    )
    shutil.rmtree(root / "checkpoints", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="the file system to write on: a directory (default: the temporary one)")
    parser.add_argument("--full", action="store_true", help="also the full-weight checkpoint (~9 GB)")
    parser.add_argument("--step-s", type=float, default=16384 / 12385, help="a training step's seconds")
    args = parser.parse_args()
    if args.dir is not None and not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir}: not a directory")
    # a fresh directory inside --dir, removed at the end: nothing already in --dir (a run's checkpoints) is touched
    root = Path(tempfile.mkdtemp(prefix="lychee-ckpt-bench-", dir=args.dir))
    try:
        measure("LoRA", lora_shapes(), torch.float32, root, args.step_s)
        if args.full:
            measure("full", full_shapes(), torch.bfloat16, root, args.step_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
