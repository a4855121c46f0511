"""The fixed config a study's trials share, recorded on the study: a sweep whose fixed config differs is refused
before it asks a trial.

A study compares trials that differ in their searched parameters only. The sweep dir and study are named by the
search config (outputs/sweeps/lr_batch, study lr_batch), so the same search run with another experiment, model or
step count found the earlier study: it counted its trials towards n_trials and reported its best. So the study
keeps a fingerprint of its fixed config (FIXED_CONFIG, a study user attribute written when the study is created):
the composed job config as written, without the `hydra` node, the searched keys and the keys that do not change
what a trial computes (IGNORED, for lychee_exp jobs). It holds the values, not a hash, so that a refusal can name
the keys that differ with both values.

The config is read unresolved: `${oc.env:HOME}/data` or `${hydra:runtime.cwd}` stay as written, so workers on
other machines running the same command (docs/sweeps.md, "Many workers, one study") compute the same fingerprint;
paths are compared as written (relative, pkg://, or absolute as given).

A study created before fingerprints (trials but no FIXED_CONFIG) adopts the first resuming sweep's, with one
warning: the study cannot tell which config its trials ran, and from then on it refuses another one.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Iterator

from omegaconf import DictConfig, OmegaConf

from lychee_exp.errors import UserError

log = logging.getLogger(__name__)

FIXED_CONFIG = "fixed_config"  # study user attribute: {"keys": {dotted key: value}, "choices": {group: option}}
SHOWN = 3  # differing keys a refusal names before "and N more"
ABSENT = "<absent>"

# lychee_exp job keys left out of the fingerprint: they change where a trial runs, what it writes or reports, or
# how fast it runs, not the numbers it computes. A subtree drops every key under it. Kernel and batching knobs that
# can change results at float level (data.packing, trainer.forward_chunks, data.eval_batch_size, precision, ...)
# stay in: a study must not compare trials computed two ways.
IGNORED = {
    "output_dir": "the trial's own directory (its study number)",
    "overwrite": "what happens to an existing run directory",
    "trainer.resume": "continuing the trial's own checkpoints",
    # a trial's result must not depend on its slot (devices_per_trial gives slot workers gpus=N): the effective batch
    # is trainer.global_batch_size (or global_tokens_per_step), reached by accumulation on any device count
    "gpus": "the devices a trial gets",
    "parallel": "how ranks run: strategy, backend, threads, timeouts, warm ranks, restarts, FSDP memory layout",
    "logger": "where metrics are sent",
    "trainer.log_every": "how often the loss is logged",
    "trainer.progress_bar": "console output",
    "trainer.measure_speedup": "a timing figure for the report",
    "trainer.save_model": "what is written at the end",
    "trainer.checkpoint_every": "what is written during training",
    "trainer.keep_checkpoints": "what is kept on disk",
    "data.num_workers": "DataLoader processes that tokenize: the same batches",
    "data.pretokenize": "tokenizing once ahead rather than per batch: the same token ids",
}


def fingerprint(job_cfg: DictConfig, searched: Iterable[str], lychee: bool) -> dict:
    """The fixed config of a trial composed from job_cfg: every key as written, but `hydra`, the searched keys
    (a searched config group drops its node) and, for lychee_exp jobs, IGNORED. Group choices ride along for the
    refusal's words only (another experiment= is what the user typed); the keys decide."""
    dropped = {_path(key) for key in searched} | (set(IGNORED) if lychee else set())
    tree = OmegaConf.to_container(job_cfg, resolve=False, enum_to_str=True, throw_on_missing=False)
    tree.pop("hydra", None)
    keys = {key: value for key, value in _flat(tree) if not _under(key, dropped)}
    choices = OmegaConf.select(job_cfg, "hydra.runtime.choices", default=None)
    choices = OmegaConf.to_container(choices) if choices is not None else {}
    kept = {g: o for g, o in choices.items() if not g.startswith("hydra/") and not _under(_path(g), dropped)}
    return _json({"keys": keys, "choices": kept})


def check(study: Any, ours: dict, location: str) -> None:
    """Records `ours` on a study that has none yet; refuses, in one line, a sweep whose fixed config differs from
    the study's. `location`: the study's storage URL (password masked)."""
    stored = study.user_attrs.get(FIXED_CONFIG)
    if stored is None:
        if study.get_trials(deepcopy=False):
            log.warning(
                "study %r in %s has no record of its fixed config (started before sweeps recorded one): "
                "recording this sweep's; a later sweep with another fixed config will be refused",
                study.study_name,
                location,
            )
        study.set_user_attr(FIXED_CONFIG, ours)
        stored = study.user_attrs[FIXED_CONFIG]  # a worker starting at the same moment may have written its own
    differing = differences(stored.get("keys", {}), ours["keys"])
    if not differing:
        return
    shown = ", ".join(f"{key}={_shown(here)} (study: {_shown(there)})" for key, here, there in differing[:SHOWN])
    more = f" and {len(differing) - SHOWN} more" if len(differing) > SHOWN else ""
    groups = differences(stored.get("choices", {}), ours.get("choices", {}))
    choices = ", ".join(f"{g}={_shown(here)} (study: {_shown(there)})" for g, here, there in groups)
    raise UserError(
        f"fixed config: this sweep differs from study {study.study_name!r} in {location}: {shown}{more}"
        f"{f' (group choices: {choices})' if choices else ''}; use another hydra.sweeper.study_name=<name> "
        "(or storage) for another fixed config"
    )


def differences(stored: dict, ours: dict) -> list[tuple[str, Any, Any]]:
    """(key, our value, the study's value) for each key that differs, in our config's order; a key only one side
    has shows ABSENT on the other."""
    keys = [*ours, *(key for key in stored if key not in ours)]
    pairs = ((key, ours.get(key, ABSENT), stored.get(key, ABSENT)) for key in keys)
    return [(key, here, there) for key, here, there in pairs if here != there]


def _flat(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf; a list is one value, an empty dict too (so that filling it shows)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def _path(key: str) -> str:
    """An override's key as a config path: `+w` -> w, a group `model/lora@x` -> model.lora."""
    return key.lstrip("+~").split("@", 1)[0].replace("/", ".")


def _under(key: str, paths: set[str]) -> bool:
    return any(key == path or key.startswith(f"{path}.") for path in paths)


def _json(value: Any) -> Any:
    """As the storage gives it back (tuples as lists, anything odd as its string), so that values compare equal."""
    return json.loads(json.dumps(value, default=str))


def _shown(value: Any, width: int = 40) -> str:
    plain = isinstance(value, str) and (value == ABSENT or bool(value) and not any(c in value for c in " ,;()'\n"))
    text = value if plain else json.dumps(value)  # a string that would not read as one value is quoted
    return text if len(text) <= width else f"{text[: width - 3]}..."
