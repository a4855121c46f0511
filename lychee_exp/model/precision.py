"""Precision, in one module: a setting resolved for its device (`trainer.precision`, rerank's `precision`: auto,
fp32, bf16, fp16), the torch dtype of each setting, and every autocast region of the product: the training step's
and scoring's mixed precision, and the fp32 region of the answer head inside them.

torch is imported where a dtype or a region is asked for, not at import: the Hydra process plans with these
settings (python -m lychee_exp.plan, the speedup calibration's key) before any training process loads torch.
"""

from __future__ import annotations

import contextlib

# x86 CPU flags of native bf16 matrix instructions (Zen 4+, Cooper Lake, Sapphire Rapids' AMX); without them
# oneDNN emulates bf16, slower than fp32
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# a memory plan (python -m lychee_exp.plan, gradient_checkpointing=auto) is for a GPU, where auto is bf16 (or fp16,
# the same bytes)
PLANNED_AUTO = "bf16"


def resolve_precision(precision: str, device) -> str:
    """precision=auto: bf16 on GPUs that have it, else fp16; on a CPU, bf16 where its matrix units compute bf16
    natively (the default job trains 1.8x faster on such a 2-core machine, docs/configuration.md), else fp32."""
    if precision != "auto":
        return precision
    if device.type != "cuda":
        return "bf16" if cpu_computes_bf16() else "fp32"
    import torch

    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def planned_precision(precision: str) -> str:
    """The precision a memory plan counts bytes in: the setting, with auto as a GPU resolves it."""
    return PLANNED_AUTO if precision == "auto" else precision


def cpu_computes_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo, encoding="utf-8") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:  # no /proc (macOS, Windows): fp32
        return False
    return not NATIVE_BF16_FLAGS.isdisjoint(flags.partition(":")[2].split())


def amp_dtype(precision: str):
    """The autocast dtype of a resolved mixed precision (bf16, fp16); None for fp32."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def weight_dtype(dtype: str):
    """model.dtype (the backbone's weights as loaded) as a torch dtype."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    """The mixed-precision region of a forward (training's micro-batches, scoring's batches): autocast to the
    resolved precision's dtype, nothing for fp32."""
    dtype = amp_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type, dtype=dtype)


def full_precision(device_type: str) -> contextlib.AbstractContextManager:
    """A region computed in fp32 inside a mixed-precision one (the answer head's two rows: model.answer_head; a
    CPU training step's attention: model.packed)."""
    import torch

    return torch.autocast(device_type, enabled=False)
