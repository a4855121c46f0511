"""A sharded run's (parallel=fsdp) trainable weights and optimizer state in a checkpoint: every rank writes and
reads its own shards with torch.distributed.checkpoint (DCP) in <step>/shards, so no rank ever holds the full
state; train.checkpoint writes the rest (progress, schedule, RNG: state.pt) and makes the step directory
visible by its atomic rename. Frozen weights (LoRA's base) are not saved: they come from model.path again."""

from __future__ import annotations

from pathlib import Path

from torch import nn

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
