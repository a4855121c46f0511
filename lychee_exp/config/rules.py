"""The rules of a run's configuration that types cannot express: numeric bounds declared beside a schema field
(`at_least`, `above`, and the `min`/`below`/`max` metadata), and the cross-field rules of a RunConfig. Both are
applied by lychee_exp.config.schema.check_config, in the Hydra process before any training process starts."""

from __future__ import annotations

import dataclasses
import string
from dataclasses import field
from pathlib import Path
from typing import Any

from lychee_exp.config.auto import (
    PACKABLE_ENCODERS,
    check_packing_setting,
    checkpoint_every,
    encoder_model_type,
    forward_chunk_count,
    parse_gpus,
)
from lychee_exp.errors import UserError


def at_least(low: float, default: Any) -> Any:
    """A field whose value must be >= low (checked by check_config, naming the key)."""
    return field(default=default, metadata={"min": low})


def above(low: float, default: Any) -> Any:
    """A field whose value must be > low."""
    return field(default=default, metadata={"above": low})


def within(low: float, high: float, default: Any) -> Any:
    """A field whose value must be in [low, high]."""
    return field(default=default, metadata={"min": low, "max": high})


def probability(default: Any) -> Any:
    """A field that is a probability of dropping something: in [0, 1) (1 would drop everything)."""
    return field(default=default, metadata={"min": 0, "below": 1})


def numbers(count: int, low: float, below: float, default: list) -> Any:
    """A list field of exactly `count` numbers, each in [low, below)."""
    return field(default_factory=lambda: list(default), metadata={"length": count, "min": low, "below": below})


def weight(default: Any) -> Any:
    """A field that is a mixing weight: in [0, 1]."""
    return field(default=default, metadata={"min": 0, "max": 1})


# the metadata key naming where a shared key is declared (tests/test_defaults.py reads it)
DECLARED_IN = "declared_in"


def declared_in(owner: Any, name: str) -> Any:
    """The field `name` of the dataclass `owner` (its default and bounds), for a key that several schemas share
    (the first stage's keys of data, mine and rerank; the seed): declared once, in owner, and placed here in this
    schema's own key order, which inheriting it would change."""
    source = next(f for f in dataclasses.fields(owner) if f.name == name)
    where = {DECLARED_IN: f"{owner.__name__}.{name}", **source.metadata}  # a key owner shares itself keeps its home
    return field(default=source.default, default_factory=source.default_factory, metadata=where)


# what numpy's and Python's seeding accept (numpy: 0 .. 2**32 - 1)
SEED_RANGE = (0, 2**32 - 1)


def check_run_config(run_cfg: Any) -> None:
    """A config.schema.RunConfig's bounds and cross-field rules; raises UserError naming the key."""
    check_bounds(run_cfg, "")
    group = run_cfg.data.train_group_size
    if run_cfg.loss.name == "listwise" and group < 2:
        raise UserError(f"data.train_group_size must be >= 2 for loss=listwise (1 positive + negatives), got {group}")
    _check_trainer(run_cfg.trainer)
    if not run_cfg.model.prompt.max_len and not run_cfg.model.prompt.doc_max_len:
        raise UserError("model.prompt.doc_max_len=0 needs a total budget: set model.prompt.max_len > 0")
    _check_template(run_cfg.model.prompt.template)
    if run_cfg.model.gradient_checkpointing not in (True, False, "auto"):
        raise UserError(
            f"model.gradient_checkpointing must be true, false or auto, got {run_cfg.model.gradient_checkpointing!r}"
        )
    if run_cfg.model.lora.dtype not in ("auto", "float32", "model"):
        raise UserError(f"model.lora.dtype must be auto, float32 or model, got {run_cfg.model.lora.dtype!r}")
    _check_mix(run_cfg.data)
    _check_packing(run_cfg)
    _check_token_budget(run_cfg)
    _check_fsdp(run_cfg)
    parse_gpus(run_cfg.gpus)
    forward_chunk_count(run_cfg.trainer.forward_chunks, "cpu")
    checkpoint_every(run_cfg.trainer.checkpoint_every)


def _check_mix(data: Any) -> None:  # a config.schema.DataConfig
    if data.first_stage_weight > 0 and not data.dataset:
        raise UserError(
            f"data.first_stage_weight={data.first_stage_weight} mixes the first stage's scores into the dev ranking: "
            "only data=beir's dev split has a first stage (set data.first_stage_weight=0)"
        )
    check_mix_weights(data.teacher_weight, data.first_stage_weight, "data.")


def _check_trainer(trainer: Any) -> None:  # a config.schema.TrainerConfig
    if trainer.max_steps == 0 or trainer.max_steps < -1:  # 0 steps is not a run: never "an epoch" in disguise
        raise UserError(f"trainer.max_steps must be -1 (train max_epochs) or >= 1, got {trainer.max_steps}")
    if trainer.max_steps == -1 and trainer.max_epochs < 1:
        raise UserError("trainer.max_epochs must be >= 1 when trainer.max_steps=-1")
    for key in ("load_best_model_at_end", "early_stopping_patience"):
        if getattr(trainer, key) and not trainer.evaluate:
            raise UserError(f"trainer.{key} ranks dev evaluations, and trainer.evaluate=false makes none")
    resume = str(trainer.resume)
    if resume in ("never", "auto"):
        return
    if not resume.strip() or not Path(resume).expanduser().is_dir():
        raise UserError(
            f"trainer.resume={resume}: expected never, auto (this run's newest checkpoint) or a checkpoint "
            "directory (<run>/checkpoints/step_N), and there is no such directory"
        )


def _check_packing(cfg: Any) -> None:  # a config.schema.RunConfig
    check_packing_setting(cfg.data.packing)
    if cfg.data.packing is not True:  # auto decides per device (config.auto.packing_on), never against these
        return
    model_type = encoder_model_type(cfg.model.path)
    if cfg.model.kind != "causal_lm" and model_type not in PACKABLE_ENCODERS:
        raise UserError(
            f"data.packing=true: model.kind={cfg.model.kind} packs BERT-family encoders only "
            f"(model_type {', '.join(PACKABLE_ENCODERS)}), and model.path={cfg.model.path} is {model_type}"
        )
    if cfg.model.attn_implementation not in ("sdpa", "eager"):
        got = cfg.model.attn_implementation
        raise UserError(f"data.packing=true needs model.attn_implementation sdpa or eager, got {got}")
    if cfg.parallel.strategy == "dp":
        raise UserError("data.packing=true cannot split a packed row over DataParallel GPUs; use parallel=ddp")


def _check_fsdp(cfg: Any) -> None:  # a config.schema.RunConfig
    fsdp = cfg.parallel.strategy == "fsdp"
    if not fsdp and (cfg.parallel.cpu_offload or not cfg.parallel.reshard_after_forward):
        key = "cpu_offload" if cfg.parallel.cpu_offload else "reshard_after_forward"
        raise UserError(f"parallel.{key} shapes sharded training: it needs parallel=fsdp, got {cfg.parallel.strategy}")
    if not fsdp:
        return
    if cfg.trainer.precision == "fp16":
        raise UserError("trainer.precision=fp16 with parallel=fsdp: use bf16 (no loss scaling over sharded gradients)")
    if cfg.trainer.forward_chunks not in ("auto", 1):
        raise UserError(
            f"trainer.forward_chunks={cfg.trainer.forward_chunks} with parallel=fsdp: every rank must run one forward "
            "per micro-batch (each gathers parameters from all ranks); use 1 or auto"
        )


def _check_token_budget(cfg: Any) -> None:  # a config.schema.RunConfig
    budget = cfg.data.max_tokens_per_batch
    if budget is None:
        return
    if isinstance(budget, bool) or budget < 1:
        raise UserError(f"data.max_tokens_per_batch must be null or an integer >= 1, got {budget!r}")
    if cfg.parallel.strategy == "dp":
        raise UserError(
            "data.max_tokens_per_batch is a per-device budget; DataParallel splits one batch: use parallel=ddp"
        )


def check_bounds(node: Any, prefix: str) -> None:
    """The bounds that at_least/above/numbers/... fields declare, over a dataclass and its nested ones."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_bounds(value, f"{key}.")
        elif value is None:  # an optional key left unset
            continue
        elif isinstance(value, (list, tuple)):
            if "length" in f.metadata and len(value) != f.metadata["length"]:
                raise UserError(f"{key} must hold {f.metadata['length']} values, got {list(value)}")
            for index, item in enumerate(value):
                _check_bound(f.metadata, item, f"{key}[{index}]")
        else:
            _check_bound(f.metadata, value, key)


def _check_bound(bounds: Any, value: Any, key: str) -> None:
    if "min" in bounds and not value >= bounds["min"]:
        raise UserError(f"{key} must be >= {bounds['min']}, got {value}")
    if "above" in bounds and not value > bounds["above"]:
        raise UserError(f"{key} must be > {bounds['above']}, got {value}")
    if "below" in bounds and not value < bounds["below"]:
        raise UserError(f"{key} must be < {bounds['below']}, got {value}")
    if "max" in bounds and not value <= bounds["max"]:
        raise UserError(f"{key} must be <= {bounds['max']}, got {value}")


def _check_template(template: str) -> None:
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise UserError(f"model.prompt.template is not a valid format string: {err}") from None
    unknown = set(fields) - {"instruction", "query", "document"}
    if unknown:
        fields_help = "use {instruction}, {query}, {document}"
        raise UserError(f"model.prompt.template has unknown field(s) {sorted(unknown)}; {fields_help}")
    for needed in ("query", "document"):
        if fields.count(needed) != 1:
            raise UserError(f"model.prompt.template must contain {{{needed}}} exactly once")


def check_mix_weights(teacher_weight: float, first_stage_weight: float, prefix: str = "") -> None:
    """The partners' weights leave the model a share of at least 0: one line naming the keys otherwise."""
    if teacher_weight + first_stage_weight > 1:
        raise UserError(
            f"{prefix}teacher_weight={teacher_weight} + {prefix}first_stage_weight={first_stage_weight} exceeds 1, "
            "which would leave the model a negative weight"
        )


RUN_PREFIX = "run:"


def check_stage(spec: str, key: str = "first_stage") -> None:
    if spec in ("bm25", "dense"):
        return
    if spec.startswith(RUN_PREFIX) and spec[len(RUN_PREFIX) :]:
        if not Path(spec[len(RUN_PREFIX) :]).expanduser().is_file():
            raise UserError(f"{key}={spec}: {spec[len(RUN_PREFIX) :]} does not exist")
        return
    raise UserError(f"{key}={spec}: expected bm25, dense or run:<TREC run file>")
