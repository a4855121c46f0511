"""Each default is written once: in the schema (lychee_exp.config.schema's dataclasses) or in a YAML file of conf/,
never in both. A YAML key that restates the value it would have anyway (the schema's, or the parent option's)
is a second home that can drift; a key of a default option (one conf/config.yaml picks, or one named
`default`) that differs from the schema, unless declared below as a choice of the default run, means the two
disagree about what a run gets without overrides. Experiment presets (conf/experiment) are recipes: each key
they set is their deliberate choice (a recipe pins its learning rate even where it equals today's default), so
they are not held to this rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lychee_exp.config.schema import CONF_DIR, RunConfig

CONF = Path(CONF_DIR)
# every conf/ group that fills a section of the run's schema (hydra/ and hparams_search/ configure Hydra)
GROUPS = sorted(path.name for path in CONF.iterdir() if path.name in {f.name for f in dataclasses.fields(RunConfig)})
IDENTITY_KEYS = {"name", "strategy"}  # the key that says which option a file is: it may equal the schema's
# What the default run deliberately sets to other than the schema's value (the default data, model and length)
DEFAULT_RUN_CHOICES = {
    "trainer/quick": {"max_steps"},
    "data/sample": {"train_file", "dev_file", "instruction", "train_group_size", "random_negatives", "teacher_weight"},
    "model/minilm_cross_encoder": {"kind", "path", "dropout", "prompt.max_len"},
}


def leaves(node: dict, prefix: str = "") -> dict:
    """A nested mapping as {dotted key: value}."""
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            flat.update(leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def schema_defaults() -> dict:
    return leaves(OmegaConf.to_container(OmegaConf.structured(RunConfig), enum_to_str=True))


def raw_option(group: str, option: str) -> dict:
    """The option's YAML as loaded; a global-package option (data=beir, which also picks the model and the lr)
    is marked `_global_`: its keys are full dotted keys of the run's config."""
    path = CONF / group / f"{option}.yaml"
    raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
    if "# @package _global_" in path.read_text().splitlines()[:2]:
        raw["_global_"] = True
    return raw


def default_options() -> set[str]:
    """group/option for each group option that conf/config.yaml composes by default."""
    picks = [entry for entry in raw_option(".", "config")["defaults"] if isinstance(entry, dict)]
    return {f"{group}/{option}" for entry in picks for group, option in entry.items() if option}


def option_problems(group: str, option: str, raw: dict, schema: dict, defaults: set[str]) -> list[str]:
    """What breaks the rule in one group option's YAML (raw, as loaded): restated or disagreeing keys."""
    inherited = {}
    full = "" if raw.pop("_global_", False) else f"{group}."  # how the file's keys name the run's keys
    for parent in raw.pop("defaults", []):  # an option built on another of its group (trainer/quick on default)
        if isinstance(parent, str):  # (a mapping overrides another group's choice: data=beir's model)
            inherited.update(leaves(raw_option(group, parent)))
    is_default = f"{group}/{option}" in defaults or option == "default"
    chosen = DEFAULT_RUN_CHOICES.get(f"{group}/{option}", set())
    problems = []
    for key, value in leaves(raw).items():
        before = inherited.get(key, schema[f"{full}{key}"])
        if key in IDENTITY_KEYS:
            continue
        if value == before:
            problems.append(f"{group}/{option}.yaml: {key}: {value!r} restates the default")
        elif is_default and key not in chosen and value != schema[f"{full}{key}"]:
            got = schema[f"{full}{key}"]
            problems.append(f"{group}/{option}.yaml: {key}: {value!r} disagrees with the schema's {got!r}")
    return problems


GROUP_OPTIONS = sorted((path.parent.name, path.stem) for group in GROUPS for path in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}/{o}" for g, o in GROUP_OPTIONS])
def test_group_option_writes_each_default_once(group, option):
    assert option_problems(group, option, raw_option(group, option), schema_defaults(), default_options()) == []


@pytest.mark.parametrize("option", sorted(DEFAULT_RUN_CHOICES))
def test_each_declared_choice_is_set_by_a_default_option_to_another_value(option):
    """The declarations cannot rot: each names a key its option sets, to a value other than the schema's."""
    group, name = option.split("/")
    assert option in default_options()
    own, schema = leaves(raw_option(group, name)), schema_defaults()
    for key in DEFAULT_RUN_CHOICES[option]:
        assert key in own and own[key] != schema[f"{group}.{key}"], f"{option}: {key}"


def test_the_rule_catches_a_restated_and_a_disagreeing_default():
    schema, defaults = schema_defaults(), default_options()
    log_every = schema["trainer.log_every"]
    assert option_problems("trainer", "default", {"log_every": log_every}, schema, defaults)  # restated
    assert option_problems("trainer", "default", {"log_every": log_every + 1}, schema, defaults)  # disagrees
    assert option_problems("parallel", "ddp", {"strategy": "ddp", "timeout_s": 1800}, schema, defaults)
    # a non-default option's own value is its choice; the identity key may name the schema's value
    assert option_problems("parallel", "dp", {"strategy": "dp", "timeout_s": 60}, schema, defaults) == []
    assert option_problems("loss", "pointwise", {"name": "pointwise"}, schema, defaults) == []


def test_top_level_config_restates_no_schema_default():
    schema = schema_defaults()
    own = {k: v for k, v in raw_option(".", "config").items() if k not in ("defaults", "hydra")}
    assert {k: v for k, v in leaves(own).items() if schema.get(k) == v} == {}
