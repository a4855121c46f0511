"""The check's weights, built once: the model drawn from a seed on the fastest device there is (the GPU: a 1.5B
model's random init on the CPU took most of a minute per run), written once as safetensors into the model
directory, and loaded by every worker of both systems. A fingerprint of the loaded tensors, exact and the same on
any device, goes into every run's record: equal fingerprints prove that the runs started from the same weights
(and, for the adapters, from the same LoRA init)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

# integer multipliers for the weighted sum below: a permutation or a changed value moves the sum
_PRIME = 1_000_003


def _tensor_sum(t: torch.Tensor) -> int:
    """An exact, order-free integer digest of a tensor's bits: sum of bits x (index mod p + 1), in int64 (wraps)."""
    flat = t.detach().reshape(-1)
    bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    weight = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % _PRIME + 1
    return int((bits.to(torch.int64) * weight).sum())


def canonical_name(name: str) -> str:
    """A parameter's name without its wrappers (lychee_exp's Reranker, peft's PeftModel)."""
    return name.rsplit("base_model.model.", 1)[-1].removeprefix("backbone.")


def fingerprints(model: torch.nn.Module) -> dict:
    """{"weights": digest of the frozen (non-adapter) tensors, "adapters": digest of the LoRA tensors}."""
    parts: dict[str, list[str]] = {"weights": [], "adapters": []}
    for name, p in sorted(model.named_parameters(), key=lambda kv: canonical_name(kv[0])):
        key = canonical_name(name).replace(".base_layer", "")
        kind = "adapters" if "lora_" in key else "weights"
        parts[kind].append(f"{key} {p.dtype} {tuple(p.shape)} {_tensor_sum(p)}")
    return {k: hashlib.sha256("\n".join(v).encode()).hexdigest()[:16] for k, v in parts.items()}


def starting_point(model: torch.nn.Module) -> dict:
    """A run's fingerprints, taken before its first step; on CUDA the digest's temporary buffers (int64 copies of
    the largest tensor) are then released and the peak-memory counters reset, so that the run's peak memory is
    the training's."""
    digest = fingerprints(model)
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return digest


def build(model_dir: Path, seed: int = 42) -> dict:
    """Draws the backbone (bf16, transformers' init) from `seed` on the GPU where there is one and writes
    model.safetensors into `model_dir` (which holds config.json and the tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(model_dir))
    fallback = None
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as err:  # noqa: BLE001 - drawing on the CPU is slower but as good (same seed, same weights)
        fallback = f"built on the CPU: {type(err).__name__}: {str(err)[:200]}"
        device = torch.device("cpu")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    built = time.perf_counter()
    digest = fingerprints(model)["weights"]
    model.save_pretrained(str(model_dir), safe_serialization=True)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return {
        "passed": True,
        "device": str(device),
        "weights_fingerprint": digest,
        "bytes": size,
        "build_s": round(built - started, 1),
        "write_s": round(time.perf_counter() - built, 1),
        **({"fallback": fallback} if fallback else {}),
    }
