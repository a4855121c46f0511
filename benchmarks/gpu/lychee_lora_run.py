"""lychee_exp's LoRA recipe on one device, timed: the Trainer itself (setup, fit) with a step hook that closes the
timed window, and its loader wrapped to log the batches it draws. With `packing: auto` the run packs its rows
(data.packing=true) where the config schema has that key, and pads them otherwise."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from benchmarks.gpu.flops import Shape, bf16_peak_tflops
from benchmarks.gpu.profile import StepProfiler
from benchmarks.gpu.timing import BatchLog, WindowClock, peak_memory, window_figures
from benchmarks.gpu.weights import starting_point
from lychee_exp.config.schema import DataConfig, RunConfig, to_run_config
from lychee_exp.parallel.memory_plan import resolve_checkpointing

FIRST_LOSSES = 5
# The one place that lists the recipe options every lychee_exp run of the check trains with: the `lychee_lora`
# experiment as shipped, plus what the check must add to it. Each mix's data.max_tokens_per_batch (where the schema
# has the key) is its Mix.token_budget, added by extra_overrides. The rest of recipe_overrides is the check's
# plumbing (model, data files, step counts, logging).
RECIPE = ["experiment=lychee_lora"]


def has_key(name: str) -> bool:
    """Whether the config schema has data.<name> (the check runs on trees with and without later keys)."""
    return name in {f.name for f in dataclasses.fields(DataConfig)}


def extra_overrides(spec: dict) -> list[str]:
    """The run's own overrides on top of the recipe, with data.packing=true where the schema has it (`packing:
    auto`); packed rows have no padding to cut, so the padded path's bucketing and forward chunks are left out.
    Where the schema has data.max_tokens_per_batch, the mix's token budget unless the run sets its own."""
    extra = list(spec.get("overrides", []))
    if has_key("max_tokens_per_batch") and not any(o.startswith("data.max_tokens_per_batch=") for o in extra):
        extra.append(f"data.max_tokens_per_batch={spec['mix']['token_budget']}")
    if spec.get("packing") == "auto" and has_key("packing") and "data.packing=false" not in extra:
        extra = [o for o in extra if not o.startswith(("trainer.forward_chunks=", "data.bucket_by_length="))]
        extra.append("data.packing=true")
    return extra


def recipe_overrides(spec: dict) -> list[str]:
    """The run both systems read their settings from: the Lychee LoRA recipe on the check's model and mix."""
    mix, steps = spec["mix"], spec["warmup"] + spec["timed"] + spec.get("profile_steps", 0)
    overrides = [
        *RECIPE,
        f"model.path={spec['model_dir']}",
        "model.random_init=false",  # the check's weights, written once (benchmarks.gpu.weights)
        "parallel=single",
        "gpus=1",
        "data=jsonl",
        f"data.train_file={spec['data']}",
        f"data.dev_file={spec['data']}",
        "data.max_dev_queries=1",
        f"data.batch_size={mix['queries_per_step']}",
        f"data.train_group_size={mix['group']}",
        "data.random_negatives=0",
        f"model.prompt.max_len={mix['max_len']}",
        "model.prompt.query_max_len=32",
        "model.prompt.instruction_max_len=32",
        "trainer.precision=bf16",
        f"trainer.max_steps={steps}",
        "trainer.evaluate=false",
        "trainer.save_model=false",
        "trainer.progress_bar=false",
        f"trainer.log_every={steps}",
        "logger=none",
        "trainer.measure_speedup=false",
        f"seed={spec.get('seed', 42)}",
    ]
    return [*overrides, *extra_overrides(spec)]


def compose(spec: dict, out: Path) -> RunConfig:
    from lychee_exp.job.in_process import compose_job

    return to_run_config(compose_job(recipe_overrides(spec), out))


def shape_of(cfg: RunConfig) -> tuple[Shape, int]:
    from lychee_exp.model.reranker import model_dir

    shape = Shape.of(json.loads((model_dir(cfg.model) / "config.json").read_text()))
    lora = shape.lora_params(cfg.model.lora.r, list(cfg.model.lora.target_modules)) if cfg.model.lora.enabled else 0
    return shape, lora


def planned(cfg: RunConfig, encoder, checkpointing: bool) -> dict:
    """parallel.memory_plan's figures for this run (`python -m lychee_exp.plan`), to read beside peak_memory_mb: the
    activations it estimates and the whole peak (state + activations), in GiB, before its x1.3 margin."""
    from lychee_exp.parallel.memory_plan import GIB, plan_memory

    plan = plan_memory(cfg, 1, "bf16", checkpointing, encoder)
    return {
        "estimated_activation_gib": round(plan.activation_bytes / GIB, 2),
        "planned_peak_gib": round(plan.peak_bytes / GIB, 2),
    }


def attention_record(decided: str, device: torch.device) -> dict:
    """The attention path decided at setup, the paths the packed attention saw, and the varlen probe's verdict."""
    from lychee_exp.model.packed import ATTENTION_PATHS, varlen_probe

    works, why = varlen_probe(device) if device.type == "cuda" else (False, "not CUDA")
    return {"attention": decided, "attention_paths_seen": sorted(ATTENTION_PATHS), "varlen_probe": {"ok": works,
            "why": why}}  # fmt: skip


def checkpointing_on(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


class RecordingLoader:
    """The trainer's DataLoader, logging every batch it yields (host tensors: no device read)."""

    def __init__(self, loader, log: BatchLog):
        self.loader, self.log = loader, log

    def __iter__(self):
        for batch in self.loader:
            self.log.add(batch)
            yield batch

    def __getattr__(self, name: str):
        if name in ("loader", "log"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def run(spec: dict, out: Path) -> dict:
    from lychee_exp.model.reranker import build_encoder, load_tokenizer
    from lychee_exp.parallel.devices import plan_devices, torch_device
    from lychee_exp.parallel.distributed import DistEnv
    from lychee_exp.train.progress import StepHooks
    from lychee_exp.train.trainer import Trainer

    cfg = compose(spec, out)
    device = torch_device("cuda" if torch.cuda.is_available() else "cpu")
    clock = WindowClock(spec["warmup"], spec["timed"], device)
    profiler = StepProfiler(spec["warmup"] + spec["timed"], spec.get("profile_steps", 0), device)  # after the window

    def after_step(step: int, model: torch.nn.Module) -> None:
        clock.step_done(step)
        profiler.step_done(step)

    hooks = StepHooks(after_step=after_step)
    trainer = Trainer(cfg, DistEnv(device=device), plan_devices("single", 1), out, hooks=hooks)
    # the checkpointing decision as setup takes it (free memory before the model is built), and why
    _, why = resolve_checkpointing(cfg, build_encoder(cfg.model, load_tokenizer(cfg.model)), device)
    trainer.setup()
    started_from = starting_point(trainer.model)
    chunks = getattr(trainer, "forward_chunks", cfg.trainer.forward_chunks)  # resolved (auto) by setup
    log = BatchLog(chunks if isinstance(chunks, int) else 1)
    trainer.data.loader = RecordingLoader(trainer.data.loader, log)
    losses: list[torch.Tensor] = []
    step = getattr(trainer, "step", None)
    loss_fn = getattr(step, "loss_fn", None)

    def keep_first_losses(*args, **kwargs):
        per_query, *rest = loss_fn(*args, **kwargs)
        if len(losses) < FIRST_LOSSES:
            losses.append(per_query.detach().float().mean())  # stays on the device until the run is over
        return (per_query, *rest)

    if loss_fn is not None:  # the window step's loss: the first losses, to set beside HF's
        step.loss_fn = keep_first_losses
    try:
        metrics = trainer.fit()
    finally:
        trainer.cleanup()
    shape, lora = shape_of(cfg)
    checkpointing = checkpointing_on(trainer.model)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    row = window_figures(log, clock, shape, lora, checkpointing, bf16_peak_tflops(name))
    row.update(peak_memory(device))
    row.update(attention_record(trainer.attention, device))
    row.update(
        {
            "system": "lychee_exp",
            "fingerprints": started_from,
            "checkpointing_why": why,
            **planned(cfg, trainer.encoder, checkpointing),
            "first_losses": [round(float(x), 5) for x in losses],
            "gradient_checkpointing": checkpointing,
            "packing": bool(getattr(cfg.data, "packing", False)),
            "forward_chunks": log.forward_chunks,
            "rows_per_step": cfg.data.batch_size * cfg.data.train_group_size,
            "steps": metrics.get("steps"),
            "levers": {
                "lora_dtype": cfg.model.lora.dtype,
                "lora_dropout": cfg.model.lora.dropout,
                "fused_adamw": trainer.optimizer.defaults.get("fused"),
                "deterministic": cfg.trainer.deterministic,
                "pretokenize": cfg.data.pretokenize,
                "compile_layers": cfg.model.compile_layers,
                "liger_kernel": cfg.model.liger_kernel,
            },
            "overrides": extra_overrides(spec),
        }
    )
    if profiler.steps:
        row["profile"] = profiler.summary()
    return row
