"""Per-device memory of a training run before it starts (`python -m lychee_exp.plan`, and gradient_checkpointing=auto).

Exact: each rank's bytes of parameters, gradients and AdamW state, counted on the model built on the meta device
(the real architecture, LoRA included, nothing allocated) with the rules a run follows: every rank holds everything
under single/dp/ddp; under fsdp each tensor is split on dim 0 as FSDP2 splits it (ceil(rows / ranks) rows per rank,
the last ranks take what is left), AdamW keeps two moments per trainable shard plus a 4-byte step counter per tensor.
These are what parallel.sharding.state_bytes measures in a run. Estimates: the activations one micro-batch keeps for its
backward (from the token slots, the shape and checkpointing), and under fsdp the parameters gathered while blocks
compute. docs/multi_gpu.md "Memory you can plan" has the formulas' sources and a table.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lychee_exp.config.choices import Strategy
from lychee_exp.config.schema import ModelConfig, RunConfig
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.errors import UserError
from lychee_exp.io.user_files import resolve_path
from lychee_exp.model.precision import planned_precision
from lychee_exp.model.reranker import KINDS, add_lora, lora_dtype, model_dir
from lychee_exp.parallel.sharding import transformer_blocks

MARGIN = 1.3  # the estimate leaves out allocator fragmentation, the CUDA context and the backward's transients
GIB = 2**30
STEP_BYTES = 4  # AdamW's step counter: a float32 scalar tensor per parameter tensor
ARCHITECTURES = Path(__file__).resolve().parent.parent / "assets" / "architectures"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    element_size: int
    trainable: bool

    def rows(self, rank: int, ranks: int) -> int:
        """dim-0 rows on `rank` of `ranks` (FSDP2's split; ranks=1: all)."""
        if not self.shape:
            return 1
        chunk = math.ceil(self.shape[0] / ranks)
        return max(0, min(chunk, self.shape[0] - rank * chunk))

    def local_bytes(self, rank: int, ranks: int) -> int:
        return self.rows(rank, ranks) * math.prod(self.shape[1:]) * self.element_size


@dataclass(frozen=True)
class RankState:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class MemoryPlan:
    strategy: str
    devices: int
    precision: str
    parameters: int
    trainable_parameters: int
    ranks: list[RankState]  # exact; one per process (single/dp: one)
    tokens: int  # token slots of one micro-batch on one device
    checkpointing: bool
    activation_bytes: int  # estimate
    gathered_bytes: int  # estimate: fsdp's unsharded parameters while blocks compute; 0 otherwise

    @property
    def peak_bytes(self) -> int:
        return max(r.total for r in self.ranks) + self.activation_bytes + self.gathered_bytes

    def fits(self, device_bytes: float) -> bool:
        return MARGIN * self.peak_bytes <= device_bytes

    def per_rank(self, key: str) -> list[int]:
        """e.g. per_rank("optimizer_bytes"): as metrics.json's optimizer_bytes_per_rank."""
        return [getattr(r, key) for r in self.ranks]


def architecture(cfg: ModelConfig):
    """The model's transformers config: model.path's config.json, else a shipped architecture (assets/architectures)
    for a Hugging Face id that is not on this machine."""
    import transformers

    extra = {"num_labels": KINDS[cfg.kind].num_labels} if KINDS[cfg.kind].num_labels else {}
    local = resolve_path(cfg.path, "model.path", must_exist=False)
    shipped = ARCHITECTURES / cfg.path
    if (local / "config.json").is_file():
        return transformers.AutoConfig.from_pretrained(str(model_dir(cfg)), **extra)
    if (shipped / "config.json").is_file():
        return transformers.AutoConfig.from_pretrained(str(shipped), **extra)
    raise UserError(
        f"model.path={cfg.path}: no config.json there; shipped architectures: {', '.join(shipped_architectures())}"
    )


_SKELETONS: dict[str, tuple[list[Tensor], torch.nn.Module]] = {}


def model_tensors(cfg: ModelConfig, precision: str) -> tuple[list[Tensor], torch.nn.Module]:
    """The parameters a run builds (tied ones once), and the skeleton model, on the meta device (the last few
    kept: a plan builds each configuration's once, whether checkpointing is on or off)."""
    key = f"{cfg!r}/{precision}"
    if key not in _SKELETONS:
        while len(_SKELETONS) >= 4:
            _SKELETONS.pop(next(iter(_SKELETONS)))
        _SKELETONS[key] = _meta_model(cfg, precision)
    return _SKELETONS[key]


def _meta_model(cfg: ModelConfig, precision: str) -> tuple[list[Tensor], torch.nn.Module]:
    import transformers

    config = architecture(cfg)
    with torch.device("meta"):
        auto_cls = getattr(transformers, KINDS[cfg.kind].auto_class)
        model = auto_cls.from_config(config, dtype=getattr(torch, cfg.dtype))
        if cfg.lora.enabled:
            model = add_lora(model, cfg)
            lora_dtype(model, cfg.lora.dtype, precision)
    return [Tensor(tuple(p.shape), p.element_size(), p.requires_grad) for p in model.parameters()], model


def state_per_rank(tensors: list[Tensor], strategy: str, devices: int) -> list[RankState]:
    """Each process's bytes of parameters, gradients and AdamW state."""
    sharded = strategy == Strategy.fsdp
    processes = devices if strategy in (Strategy.ddp, Strategy.fsdp) else 1
    ranks = devices if sharded else 1
    states = []
    for rank in range(processes if sharded else 1):
        params = sum(t.local_bytes(rank, ranks) for t in tensors)
        grads = sum(t.local_bytes(rank, ranks) for t in tensors if t.trainable)
        steps = STEP_BYTES * sum(t.trainable for t in tensors)
        states.append(RankState(params, grads, 2 * grads + steps))
    return states if sharded else states * processes


def gathered_bytes(model: torch.nn.Module, cfg: RunConfig, precision: str) -> int:
    """fsdp: the unsharded parameters in compute dtype while blocks run: the root's (embeddings, head, final norm;
    FSDP2 keeps the root gathered from forward to backward), plus two blocks (the one computing and the next one
    prefetched), or every block with reshard_after_forward=false."""
    if cfg.parallel.strategy != Strategy.fsdp:
        return 0
    blocks = transformer_blocks(model)

    def size(module: torch.nn.Module) -> int:
        return sum(p.numel() * (2 if precision == "bf16" else p.element_size()) for p in module.parameters())

    in_blocks = sum(size(b) for b in blocks)
    root = size(model) - in_blocks
    held = in_blocks if not cfg.parallel.reshard_after_forward else 2 * max(map(size, blocks), default=0)
    return root + held


def prompt_width(prompt, template_len: int, kind: str = "") -> int:
    """The most tokens one prompt can have (the widest row a batch can be padded to). A bi-encoder's row is two
    texts, each up to max_len (data.pair_prompt.TextsApartEncoder)."""
    if prompt.max_len:
        return 2 * prompt.max_len - 1 if kind == "bi_encoder" else prompt.max_len
    return template_len + (prompt.instruction_max_len or 256) + prompt.query_max_len + prompt.doc_max_len


def micro_batch_tokens(cfg: RunConfig, encoder: PromptEncoder | None = None) -> int:
    """Token slots of one device's micro-batch: the token budget (packed: exactly; padded: at most), else rows x
    the widest prompt (without model.prompt.max_len, the template's length is read from the model's tokenizer)."""
    if cfg.data.max_tokens_per_batch:
        return cfg.data.max_tokens_per_batch
    if encoder is None and not cfg.model.prompt.max_len:
        from lychee_exp.model.reranker import build_encoder, load_tokenizer

        encoder = build_encoder(cfg.model, load_tokenizer(cfg.model))
    width = prompt_width(cfg.model.prompt, getattr(encoder, "template_len", 0), cfg.model.kind)
    return cfg.data.batch_size * cfg.data.train_group_size * width


def activation_bytes(shape: dict, model: ModelConfig, tokens: int, checkpointing: bool, precision: str) -> int:
    """Activations kept for the backward of one micro-step of `tokens` token slots (an estimate, see docs/gpu_check.md):
    per layer and token, the tensors a decoder layer saves (norm inputs, q/k/v, attention output, four MLP-wide
    tensors) plus the LoRA adapters' own (their dropped-out input, float32 when peft casts it up). With
    checkpointing only each layer's input is kept, plus one layer's activations while it is recomputed."""
    d, ffn, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    e = 2 if precision in ("bf16", "fp16") or model.dtype != "float32" else 4
    per_layer = e * (8 * d + 4 * ffn)
    if model.lora.enabled:
        inputs = 6 * d + ffn  # what the seven adapters read: q/k/v, o, gate/up from d, down from the MLP width
        upcast = model.lora.dtype == "float32" and e == 2
        per_layer += inputs * ((4 if upcast else e if model.lora.dropout > 0 else 0) + (model.lora.dropout > 0))
    if checkpointing:
        return tokens * (layers * d * e + per_layer)
    return tokens * layers * per_layer


def model_shape(model: ModelConfig) -> dict | None:
    config = architecture(model).to_dict()
    config = config.get("text_config", config)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    return config if all(config.get(k) for k in keys) else None


def plan_memory(
    cfg: RunConfig, devices: int, precision: str, checkpointing: bool, encoder: PromptEncoder | None = None
) -> MemoryPlan:
    """The plan of one configuration on `devices` devices, with checkpointing on or off (a bool, not auto)."""
    tensors, model = model_tensors(cfg.model, precision)
    tokens = micro_batch_tokens(cfg, encoder)
    shape = model_shape(cfg.model)
    if shape is None:
        raise UserError(f"model.path={cfg.model.path}: its config.json lacks the sizes an activation estimate needs")
    return MemoryPlan(
        strategy=str(cfg.parallel.strategy),
        devices=devices,
        precision=precision,
        parameters=sum(math.prod(t.shape) for t in tensors),
        trainable_parameters=sum(math.prod(t.shape) for t in tensors if t.trainable),
        ranks=state_per_rank(tensors, cfg.parallel.strategy, devices),
        tokens=tokens,
        checkpointing=checkpointing,
        activation_bytes=activation_bytes(shape, cfg.model, tokens, checkpointing, precision),
        gathered_bytes=gathered_bytes(model, cfg, precision),
    )


def shipped_architectures() -> list[str]:
    return sorted(str(p.parent.relative_to(ARCHITECTURES)) for p in ARCHITECTURES.glob("*/*/config.json"))


def resolve_checkpointing(cfg: RunConfig, encoder: PromptEncoder, device: torch.device) -> tuple[bool, str]:
    """model.gradient_checkpointing as a bool, and why. auto: off on the CPU (memory is not what limits it there);
    on CUDA, off when the plan without checkpointing (state, activations of the micro-step, fsdp's gathered
    parameters) fits in the device's free memory with the margin, else on."""
    value = cfg.model.gradient_checkpointing
    if value != "auto":
        return bool(value), "set"
    if device.type != "cuda":
        return False, "auto: CPU"
    if model_shape(cfg.model) is None:
        return True, "auto: unknown model shape"
    free, _ = torch.cuda.mem_get_info(device)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    plan = plan_memory(cfg, world, planned_precision(str(cfg.trainer.precision)), checkpointing=False, encoder=encoder)
    need = MARGIN * plan.peak_bytes
    slots = f"{plan.tokens} token slots"
    why = f"auto: {need / GIB:.1f} GiB estimated without checkpointing ({slots}), {free / GIB:.1f} free"
    return need > free, why


def resolved_model_config(cfg: RunConfig, encoder: PromptEncoder, device: torch.device) -> ModelConfig:
    """cfg.model with gradient_checkpointing decided (a bool), logged once."""
    on, why = resolve_checkpointing(cfg, encoder, device)
    if cfg.model.gradient_checkpointing == "auto":
        log.info("gradient checkpointing %s (%s)", "on" if on else "off", why)
    return dataclasses.replace(cfg.model, gradient_checkpointing=on)
