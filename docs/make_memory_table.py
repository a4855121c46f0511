"""Prints the per-device memory table of docs/multi_gpu.md ("Memory you can plan") from parallel.memory_plan, the
planner behind `python -m lychee_exp.plan` (tests/test_plan.py checks that the docs hold this output).

    python docs/make_memory_table.py

Every row: experiment=lychee_lora (packed micro-batches of 16,384 tokens per device, bf16 autocast) on 8 devices;
LoRA r=64 on bf16 weights, or full fine-tuning of float32 weights (AdamW on float32 master weights).
"""

from __future__ import annotations

MODELS = {
    "Lychee 1.5B": ["model=lychee_rerank", "model.path=vec-ai/lychee-rerank"],
    "Qwen3-Reranker-4B": ["model=qwen3_reranker", "model.path=Qwen/Qwen3-Reranker-4B"],
    "Qwen3-Reranker-8B": ["model=qwen3_reranker", "model.path=Qwen/Qwen3-Reranker-8B"],
}
TUNING = {"LoRA": [], "full": ["model.lora.enabled=false", "model.dtype=float32"]}
DEVICES, SIZES = 8, (24, 80, 141)


def table() -> str:
    from lychee_exp.cli import command_config
    from lychee_exp.config.schema import RunConfig
    from lychee_exp.parallel.memory_plan import GIB, plan_memory

    lines = [
        f"| model | tuning | parallel ({DEVICES} devices) | weights + grads + AdamW | activations, checkpointing "
        f"off / on | peak, off / on | {' | '.join(f'{s} GiB' for s in SIZES)} |",
        "|---|---|---|---|---|---|" + "---|" * len(SIZES),
    ]
    for model, model_args in MODELS.items():
        for tuning, tuning_args in TUNING.items():
            for strategy in ("ddp", "fsdp"):
                args = ["experiment=lychee_lora", *model_args, *tuning_args, f"parallel={strategy}", "output_dir=."]
                cfg = command_config("config", [*args, f"gpus={DEVICES}"], RunConfig)
                off, on = (plan_memory(cfg, DEVICES, "bf16", c) for c in (False, True))
                state = max(r.total for r in off.ranks)
                fits = ("yes" if off.fits(s * GIB) else "checkpointing" if on.fits(s * GIB) else "no" for s in SIZES)
                lines.append(
                    f"| {model} | {tuning} | {strategy} | {state / GIB:.1f} | {off.activation_bytes / GIB:.1f} / "
                    f"{on.activation_bytes / GIB:.1f} | {off.peak_bytes / GIB:.1f} / {on.peak_bytes / GIB:.1f} | "
                    + " | ".join(fits)
                    + " |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
