"""Periodic training checkpoints, written atomically and loaded without unpickling arbitrary objects.

Layout: <run>/checkpoints/step_000120/{model.safetensors, state.pt} and <run>/checkpoints/latest (a file naming
the newest complete checkpoint). A checkpoint is written into a temporary directory and renamed into place,
then `latest` is replaced atomically: a crash mid-write leaves the previous checkpoint as the latest.
model.safetensors holds the trainable parameters (all of them, or just LoRA's); state.pt holds optimizer,
scheduler, scaler, progress and RNG states as tensors and plain containers, read with weights_only=True.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lychee_exp.atomic import write_text_atomic

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / CHECKPOINT_DIR


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": json.dumps(random.getstate()), "torch": torch.get_rng_state(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


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


def save_checkpoint(output_dir: Path, step: int, model: torch.nn.Module, state: dict, keep: int) -> Path:
    """Called on the main rank only; `state` holds everything but the weights."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model), str(tmp / "model.safetensors"))
    torch.save(state, tmp / "state.pt")
    for name in ("model.safetensors", "state.pt"):
        with open(tmp / name, "rb") as handle:
            os.fsync(handle.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_text_atomic(root / LATEST, final.name + "\n")
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = checkpoint_root(output_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoint_root(output_dir) / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() and (path / "model.safetensors").is_file() else None


def load_checkpoint(path: Path, model: torch.nn.Module) -> dict:
    """Loads the weights into model and returns the rest of the state (all ranks call this)."""
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    wanted = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or wanted & set(missing):
        raise RuntimeError(f"checkpoint {path} does not match the model: unexpected {unexpected[:3]}, "
                           f"missing {sorted(wanted & set(missing))[:3]}")
    return torch.load(path / "state.pt", map_location="cpu", weights_only=True)


def save_training_state(output_dir: Path, model: torch.nn.Module, optimizer, scheduler, scaler, env,
                        progress: dict, keep: int) -> Path | None:
    """Collective (every rank's RNG state is gathered, so dropout continues as it would have); rank 0 writes."""
    rngs = env.gather_objects(rng_state())
    if not env.is_main:
        return None
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
             **{k: progress[k] for k in ("step", "epoch", "batch", "evaluated_at")},
             "summary": json.dumps(progress["summary"]), "rng": rngs, "world_size": env.world_size}
    return save_checkpoint(output_dir, progress["step"], model, state, keep)


def restore_training_state(path: Path, model: torch.nn.Module, optimizer, scheduler, scaler, env) -> dict:
    """Loads a checkpoint on every rank; returns the progress to continue from."""
    state = load_checkpoint(path, model)
    if state["world_size"] != env.world_size:
        raise ValueError(f"checkpoint {path} was written by {state['world_size']} ranks, this run has "
                         f"{env.world_size}; resume with the same gpus")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"][env.rank])
    return {**{k: state[k] for k in ("step", "epoch", "batch", "evaluated_at")},
            "summary": json.loads(state["summary"])}
