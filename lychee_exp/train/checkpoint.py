"""What training writes: periodic checkpoints (written atomically, loaded without unpickling arbitrary objects) and
the trained model as one Hugging Face directory (<run>/model, from any strategy's model).

Layout: <run>/checkpoints/step_000120/{model.safetensors, state.pt} and <run>/checkpoints/latest (a file naming the
newest complete checkpoint); a sharded run (fsdp) has shards/ instead of model.safetensors and the optimizer's state:
every rank writes and reads its own shards with torch.distributed.checkpoint (DCP), so no rank ever holds the full
state, and frozen weights (LoRA's base) are not saved: they come from model.path again. A checkpoint is written into a
temporary directory and renamed into place, then `latest` is replaced atomically: a crash mid-write leaves the previous
checkpoint as the latest. With trainer.load_best_model_at_end each new best dev evaluation is checkpointed too, and
pruning keeps its directory beside the newest `keep_checkpoints` (Hugging Face's save_total_limit does the same).
model.safetensors holds the trainable parameters (all of them, or just LoRA's); state.pt holds optimizer,
scheduler, scaler, progress and RNG states as tensors and plain containers, read with weights_only=True.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lychee_exp.config.schema import ModelConfig, RunConfig
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.errors import write_failure
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.model.files import match_umask
from lychee_exp.model.model_card import RunRecord
from lychee_exp.model.reranker import load_reranker, rewrite_run_card, save_reranker
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.parallel.sharding import is_sharded, unsharded_copy
from lychee_exp.train.best import Best
from lychee_exp.train.progress import Progress

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint saves and restores besides the progress: the model and its optimizer, learning-rate
    scheduler and gradient scaler, and the rank's DistEnv (the collectives and the world size to match)."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    scaler: Any
    env: Any  # parallel.distributed.DistEnv


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / CHECKPOINT_DIR


def step_dir(output_dir: Path, step: int) -> Path:
    """The checkpoint of a step of the run."""
    return checkpoint_root(output_dir) / f"step_{step:06d}"


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": json.dumps(random.getstate()),
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    python_state = json.loads(state["python"])
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().contiguous().clone() for name, p in model.named_parameters() if p.requires_grad}


def _tmp_dir(output_dir: Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f".tmp_step_{step:06d}"


def _empty_tmp_dir(output_dir: Path, step: int) -> Path:
    tmp = _tmp_dir(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_checkpoint(
    output_dir: Path, step: int, model: torch.nn.Module | None, state: dict, keep: int, protect: int = -1
) -> Path | None:
    """Called on the main rank only; `state` holds everything but the weights. model=None: the weights are in
    the step's temporary directory already (shards written by every rank). Older checkpoints beyond the newest
    `keep` are deleted, except step `protect`'s (the best evaluation's, with trainer.load_best_model_at_end).

    A write that the storage refuses (a full disk, a quota) is a warning, not the run's end: the checkpoint is
    insurance, and the run goes on with its older ones (and may still have room for model/, which is smaller);
    returns None then."""
    root = checkpoint_root(output_dir)
    final = step_dir(output_dir, step)
    tmp = _empty_tmp_dir(output_dir, step) if model is not None else _tmp_dir(output_dir, step)
    written = ["state.pt"]
    try:
        if model is not None:
            save_file(trainable_state(model), str(tmp / "model.safetensors"))
            written.append("model.safetensors")
        torch.save(state, tmp / "state.pt")
        match_umask(tmp)  # safetensors writes 0600: the run's other files follow the user's umask
        for name in written:
            with open(tmp / name, "rb") as handle:
                os.fsync(handle.fileno())
    except Exception as err:
        reason = write_failure(err)
        if reason is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        newest = latest_checkpoint(output_dir)
        log.warning(
            "checkpoint of step %d not written: %s; training goes on (%s)",
            step,
            reason,
            f"the newest checkpoint is {newest}" if newest else "no checkpoint of this run yet",
        )
        return None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_text_atomic(root / LATEST, final.name + "\n")
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        if old != step_dir(output_dir, protect):
            shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(path: Path) -> bool:
    return (path / "state.pt").is_file() and ((path / "model.safetensors").is_file() or has_shards(path))


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that pointer is missing or stale, the newest complete step directory."""
    root = checkpoint_root(output_dir)
    pointer = root / LATEST
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    if named is not None and named.name and _complete(named):
        return named
    steps = [path for path in sorted(root.glob("step_*"), reverse=True) if _complete(path)]
    return steps[0] if steps else None


def older_checkpoints(path: Path) -> list[Path]:
    """Complete checkpoints of the same run older than path, newest first."""
    return [
        other
        for other in sorted(path.parent.glob("step_*"), reverse=True)
        if other.name < path.name and _complete(other)
    ]


def load_checkpoint(path: Path, training: TrainingState) -> dict:
    """Loads the weights into the model (a sharded run: and the optimizer state) and returns the rest of the
    state (all ranks call this). Both files are read before the model changes: a damaged checkpoint leaves the
    model as it was. Shards are read into the model's own tensors, so a damaged sharded checkpoint may leave
    part of them written: the next candidate loaded overwrites every trained weight and the optimizer state."""
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    model = training.model
    if has_shards(path):
        load_shards(path, model, training.optimizer)
        return state
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    wanted = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or wanted & set(missing):
        raise RuntimeError(
            f"checkpoint {path} does not match the model: unexpected {unexpected[:3]}, "
            f"missing {sorted(wanted & set(missing))[:3]}"
        )
    return state


def load_step_weights(output_dir: Path, step: int, training: TrainingState) -> Path | None:
    """Collective: the weights of the run's checkpoint of `step` into the model (a sharded run: and the optimizer
    state, which nothing reads after); its path, or None when that checkpoint is not on disk."""
    path = step_dir(output_dir, step)
    if not _complete(path):
        return None
    load_checkpoint(path, training)
    return path


def save_training_state(
    output_dir: Path, training: TrainingState, progress: Progress, keep: int, protect: int = -1
) -> Path | None:
    """Collective (every rank's RNG state is gathered, so dropout continues as it would have); rank 0 writes
    and returns the checkpoint's path (the other ranks: None). `protect`: a step whose checkpoint pruning keeps
    (save_checkpoint)."""
    env = training.env
    rngs = env.gather_objects(rng_state())
    sharded = is_sharded(training.model)
    if sharded:  # every rank writes its shards into the step's temporary directory, emptied by rank 0 first
        if env.is_main:
            _empty_tmp_dir(output_dir, progress.step)
        env.gather_objects(None)
        save_shards(_tmp_dir(output_dir, progress.step), training.model, training.optimizer)
    if not env.is_main:
        return None
    state = {
        **({} if sharded else {"optimizer": training.optimizer.state_dict()}),
        "scheduler": training.scheduler.state_dict(),
        "scaler": training.scaler.state_dict(),
        **{k: getattr(progress, k) for k in ("step", "epoch", "batch", "evaluated_at")},
        "summary": json.dumps(progress.summary),
        "best": json.dumps(dataclasses.asdict(progress.best)),
        "rng": rngs,
        "world_size": env.world_size,
    }
    return save_checkpoint(output_dir, progress.step, None if sharded else training.model, state, keep, protect)


def load_readable(path: Path, training: TrainingState, fall_back: bool, report: bool) -> tuple[Path, dict]:
    """Loads path, or (fall_back) the newest older checkpoint of the run that can be read, reporting each
    unreadable one in one line (e.g. a state.pt truncated by a node that died mid-write outside our atomic
    rename, or a damaged disk). Every rank sees the same files, so all ranks pick the same checkpoint."""
    candidates = [path, *older_checkpoints(path)] if fall_back else [path]
    for candidate in candidates:
        try:
            return candidate, load_checkpoint(candidate, training)
        except Exception as err:  # safetensors, zip reader and unpickler errors have no common base
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            if candidate is candidates[-1]:
                raise RuntimeError(
                    f"no readable checkpoint: {candidate} cannot be read ({type(err).__name__}: {reason})"
                ) from None
            if report:
                log.warning(
                    "checkpoint %s cannot be read (%s: %s); resuming from the previous one",
                    candidate,
                    type(err).__name__,
                    reason,
                )
    raise AssertionError("unreachable")


def resume_path(resume: str, output_dir: Path) -> Path | None:
    """trainer.resume: "never", "auto" (the run's newest checkpoint, if any) or a checkpoint's path."""
    if resume == "never":
        return None
    return latest_checkpoint(output_dir) if resume == "auto" else Path(resume)


def restore_training_state(path: Path, training: TrainingState) -> Progress:
    """Loads a checkpoint on every rank (with resume=auto, the newest readable one); returns the progress to
    continue from, with the checkpoint it came from as its source."""
    in_a_run = path.parent.name == CHECKPOINT_DIR  # a step directory of a run: its older ones may stand in
    env = training.env
    path, state = load_readable(path, training, fall_back=in_a_run, report=env.is_main)
    if state["world_size"] != env.world_size:
        raise ValueError(
            f"checkpoint {path} was written by {state['world_size']} ranks, this run has "
            f"{env.world_size}; resume with the same gpus"
        )
    if "optimizer" in state:  # else restored with the shards
        training.optimizer.load_state_dict(state["optimizer"])
    training.scheduler.load_state_dict(state["scheduler"])
    training.scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"][env.rank])
    fields = {k: state[k] for k in ("step", "epoch", "batch", "evaluated_at")}
    best = Best(**json.loads(state["best"])) if "best" in state else Best()  # checkpoints written before: none yet
    progress = Progress(**fields, summary=json.loads(state["summary"]), best=best, source=path)
    if env.is_main:
        at = progress
        log.info("resumed from %s at step %d (epoch %d, batch %d)", at.source, at.step, at.epoch, at.batch)
    return progress


def save_model(
    model: nn.Module,
    out_dir: Path,
    model_cfg: ModelConfig,
    encoder: PromptEncoder,
    tokenizer,
    cfg: RunConfig,
    env: DistEnv,
    metrics: dict,
    evaluated: bool = True,
) -> None:
    """Called on every rank; the main rank writes. A sharded model (fsdp) is gathered once into an unsharded copy
    on the main rank (collective), so model/ loads exactly as a DDP run's does. `model_cfg`: the model config the
    run resolved (parallel.memory_plan.resolved_model_config); `metrics`: the run's final ones, for the model card
    (evaluated=False: the figures so far, before the final dev evaluation; rewrite_model_card adds its figures)."""
    sharded = is_sharded(model)
    if sharded:
        build = functools.partial(load_reranker, model_cfg, encoder, cfg.seed, training=True)
        model = unsharded_copy(model, build, env.is_main)
    if env.is_main:
        mix = {
            "teacher_weight": cfg.data.teacher_weight,
            "first_stage_weight": cfg.data.first_stage_weight,
            "teacher": dataclasses.asdict(cfg.data.dense),
        }
        # before the final evaluation the run goes on with its adapters (evaluation, a best restored): kept (a
        # sharded model's unsharded copy is a copy already)
        record = RunRecord(cfg, metrics, evaluated)
        save_reranker(model, tokenizer, cfg.model, out_dir, mix, record, keep_adapter=not evaluated and not sharded)


def rewrite_model_card(out_dir: Path, cfg: RunConfig, env: DistEnv, metrics: dict) -> None:
    """The main rank rewrites the card of the model that save_model wrote with the run's final metrics (its weights
    unchanged since); the other ranks have nothing to do."""
    if env.is_main:
        rewrite_run_card(out_dir, cfg.model, RunRecord(cfg, metrics))


SHARDS = "shards"


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)


def has_shards(path: Path) -> bool:
    return (path / SHARDS / ".metadata").is_file()  # DCP writes its metadata last, on rank 0


def save_shards(directory: Path, model: nn.Module, optimizer) -> None:
    """Collective: every rank's shards of the trainable weights and optimizer state into directory/shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options())
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / SHARDS))


def load_shards(path: Path, model: nn.Module, optimizer) -> None:
    """Collective: each rank reads its shards of path/shards into the model and optimizer (DCP raises on every
    rank when a file cannot be read, so all ranks fall back together)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options())
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path / SHARDS))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=_options()
    )
