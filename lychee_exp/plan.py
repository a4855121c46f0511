r"""Entry point: `python -m lychee_exp.plan [a run's overrides] [device_gib=24,80,141]`.

Does a configuration fit a device, before anything starts? Composes the run the same overrides would run and
prints one device's memory: parameters, gradients and AdamW state exactly as the run will hold them (per rank
under fsdp), the activations of one micro-batch and fsdp's gathered parameters as estimates, and for each device
size whether it fits (with gradient checkpointing, when `model.gradient_checkpointing=auto` needs it). Models
that are not on this machine are sized from a shipped architecture (`model.path=Qwen/Qwen3-Reranker-8B`, ...);
nothing is downloaded or allocated.

    python -m lychee_exp.plan experiment=lychee_lora model.path=vec-ai/lychee-rerank parallel=fsdp gpus=8
    python -m lychee_exp.plan experiment=lychee_lora model=qwen3_reranker model.path=Qwen/Qwen3-Reranker-8B \
        model.lora.enabled=false parallel=fsdp gpus=8 device_gib=80
"""

from __future__ import annotations

import sys

from lychee_exp.config.schema import RunConfig, check_config
from lychee_exp.errors import UserError

DEVICE_KEY = "device_gib"
DEVICE_GIB = (24.0, 80.0, 141.0)


def split_device_sizes(argv: list[str]) -> tuple[tuple[float, ...], list[str]]:
    """device_gib=<sizes> (the plan's own key) and the run's overrides."""
    sizes, overrides = DEVICE_GIB, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key != DEVICE_KEY:
            overrides.append(arg)
            continue
        try:
            sizes = tuple(float(v) for v in value.strip("[]").split(",") if v.strip())
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) <= 0:
            raise UserError(f"{DEVICE_KEY}={value}: expected device sizes in GiB, e.g. {DEVICE_KEY}=24,80,141")
    return sizes, overrides


def devices_of(cfg: RunConfig) -> int:
    """The devices the run would use, by the run's own rules and one-line errors (parallel.devices.plan_devices:
    gpus=0, -2, more GPUs than are visible, parallel=single with gpus=2). On a machine without CUDA the plan is
    for a machine with the GPUs asked for, so those are taken as there."""
    import torch

    from lychee_exp.config.auto import parse_gpus
    from lychee_exp.parallel.devices import plan_devices

    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    requested = parse_gpus(cfg.gpus)
    if requested is None and not here:
        if cfg.parallel.strategy in ("single", "dp"):  # one device's memory whatever the count (dp: each GPU's)
            return 1
        raise UserError(
            f"gpus=auto: no CUDA device here; give the devices to plan for (parallel={cfg.parallel.strategy} gpus=N)"
        )
    plan = plan_devices(
        cfg.parallel.strategy, cfg.gpus, cuda_count=here or requested, cores=1, cpu_offload=cfg.parallel.cpu_offload
    )
    return plan.num_devices


def describe(cfg: RunConfig, sizes: tuple[float, ...]) -> list[str]:
    """The plan's lines: the run, one device's memory, and whether it fits each size."""
    from lychee_exp.model.precision import planned_precision
    from lychee_exp.parallel.memory_plan import GIB, MARGIN, plan_memory

    precision = planned_precision(str(cfg.trainer.precision))
    devices = devices_of(cfg)
    setting = cfg.model.gradient_checkpointing
    options = [bool(setting)] if setting != "auto" else [False, True]
    plans = {on: plan_memory(cfg, devices, precision, on) for on in options}
    plan = plans[options[0]]
    rank = max(range(len(plan.ranks)), key=lambda r: plan.ranks[r].total)
    state = plan.ranks[rank]
    lora = f" (LoRA r={cfg.model.lora.r})" if cfg.model.lora.enabled else ""
    budget = "data.max_tokens_per_batch" if cfg.data.max_tokens_per_batch else "rows x the widest prompt"
    whose = f"rank {rank} of {len(plan.ranks)}, the largest" if plan.strategy == "fsdp" else "every rank"

    def gib(n: int) -> str:
        return f"{n / GIB:8.2f} GiB"

    lines = [
        f"model.path={cfg.model.path}: {plan.parameters:,} parameters, {plan.trainable_parameters:,} trainable{lora}",
        f"parallel={plan.strategy} on {devices} device(s), precision {precision}, {plan.tokens:,} token slots per "
        f"micro-batch ({budget})",
        f"per device ({whose}):",
        f"  parameters       exact    {gib(state.param_bytes)}  ({state.param_bytes:,} bytes)",
        f"  gradients        exact    {gib(state.grad_bytes)}  ({state.grad_bytes:,} bytes)",
        f"  AdamW state      exact    {gib(state.optimizer_bytes)}  ({state.optimizer_bytes:,} bytes)",
    ]
    for on, p in plans.items():
        lines.append(
            f"  activations      estimate {gib(p.activation_bytes)}  (gradient checkpointing {'on' if on else 'off'})"
        )
    if plan.gathered_bytes:
        lines.append(f"  gathered (fsdp)  estimate {gib(plan.gathered_bytes)}  (unsharded while blocks compute)")
    for on, p in plans.items():
        ckpt = f", checkpointing {'on' if on else 'off'}" if len(plans) > 1 else ""
        margin = f"x{MARGIN} margin: {MARGIN * p.peak_bytes / GIB:.1f} GiB{ckpt}"
        lines.append(f"  peak             estimate {gib(p.peak_bytes)}  ({margin})")
    verdicts = []
    for size in sizes:
        fitting = [on for on, p in plans.items() if p.fits(size * GIB)]
        verdict = "no" if not fitting else "yes" if fitting[0] == options[0] else "with gradient checkpointing"
        verdicts.append(f"{size:g} GiB: {verdict}")
    lines.append("fits: " + "; ".join(verdicts))
    return lines


def main(argv: list[str] | None = None) -> None:
    from lychee_exp.cli import command_config
    from lychee_exp.job.context import register_config

    register_config()  # the run's schema (lychee_schema), which conf/config.yaml composes on

    try:
        sizes, overrides = split_device_sizes(list(sys.argv[1:] if argv is None else argv))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # no run directory: output_dir is Hydra's run dir, which composing alone does not set
    if not any(o.startswith("output_dir=") for o in overrides):
        overrides.append("output_dir=.")
    own = {DEVICE_KEY: (list(DEVICE_GIB), "the device sizes (GiB) the plan says fits / does not fit for")}
    cfg = command_config("config", overrides, RunConfig, own_keys=own)
    try:
        check_config(cfg)  # what the run would refuse, refused as the run says it
        print("\n".join(describe(cfg, sizes)))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
