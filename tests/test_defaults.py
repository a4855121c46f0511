"""Each default is written once. The schema (lychee_exp.config.schema, the mine and rerank schemas of
lychee_exp.config.commands, the sweeper's hydra_plugins/lychee_optuna_sweeper/config.py, Hydra's own defaults) holds
the value a run gets when no group option or preset says otherwise; a YAML file of conf/ states only where it
differs. A second writing is a key written with the value it would have anyway, which can only drift:

- a group option's key (conf/<group>/<option>.yaml) equal to its parent option's (trainer/quick on
  trainer/default) or, without one, the schema's;
- a layer's key (a model's recipe, an experiment preset, an hparams_search config, conf/config.yaml, mine.yaml or
  rerank.yaml) that every layer below it writes alike: the schema and every group option that can precede it (any
  of them may be chosen on the command line), the model recipes before a preset, the recipes and presets before a
  search, a search's parent (lr_tokens on lr_batch);
- a defaults-list pick (`override /trainer: quick`) that names what conf/config.yaml (or a parent) picks anyway,
  unless another option below picks otherwise (data=beir picks the bi-encoder model);
- a key declared with a default in two schema dataclasses: a key several schemas share (the first stage's, the
  seed) is declared once and placed elsewhere with lychee_exp.config.rules.declared_in.

docs/configuration.md's table of the default run is checked against the composed config, value and origin."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, OmegaConf

from hydra_plugins.lychee_optuna_sweeper.config import SAMPLERS, LycheeOptunaSweeperConf
from lychee_exp.config.commands import MineConfig, RerankConfig
from lychee_exp.config.rules import DECLARED_IN, declared_in
from lychee_exp.config.schema import CONF_DIR, RunConfig
from lychee_exp.job.context import register_config

CONF = Path(CONF_DIR)
REPO = CONF.parent
# the conf/ groups that fill a section of the run's schema, in conf/config.yaml's order; then the layers above them
GROUPS = [f.name for f in dataclasses.fields(RunConfig) if (CONF / f.name).is_dir()]
# the layers above the groups, lowest first as conf/config.yaml composes them: a model's own recipe, a preset, a search
LAYER_GROUPS = ("model_recipe", "experiment", "hparams_search")
COMMANDS = {"mine": MineConfig, "rerank": RerankConfig}
# The key that says which option a file is may name the schema's value (loss/pointwise.yaml: `name: pointwise`):
# without it, choosing the option would select whatever the schema's default happens to be.
IDENTITY_KEYS = {"name", "strategy"}
# Names that schema dataclasses declare for different settings, each with its own default (owner.field: the
# declarations, shared ones named by their declared_in).
DIFFERENT_SETTINGS = {
    "name": ({"LossConfig.name", "OptimizerConfig.name", "LoggerConfig.name"}, "each section's registered option"),
    "batch_size": (
        {"DataConfig.batch_size", "DenseConfig.batch_size", "DataConfig.eval_batch_size"},
        "queries per device per step; texts per encoder pass; pairs per scoring pass (mine's and rerank's)",
    ),
    "max_len": ({"PromptConfig.max_len", "DenseConfig.max_len"}, "a pair's prompt budget; each text's, encoded"),
    "dropout": ({"LoraConfig.dropout", "ModelConfig.dropout"}, "the adapters' own; an override of the backbone's"),
    "dtype": ({"LoraConfig.dtype", "ModelConfig.dtype"}, "the adapter weights'; the loaded weights'"),
    "model": ({"DenseConfig.model", "RunConfig.model"}, "the bi-encoder's path; the reranker's section"),
    "split": ({"MineConfig.split", "RerankConfig.split"}, "mining reads the train split, reranking the test split"),
    "gpus": ({"RunConfig.gpus", "RerankConfig.gpus"}, "training takes every device (auto), rerank one unless asked"),
    "teacher_weight": (
        {"DataConfig.teacher_weight", "RerankConfig.teacher_weight"},
        "rerank's null reads the weight the model directory was trained with (its card)",
    ),
    "first_stage_weight": (
        {"DataConfig.first_stage_weight", "RerankConfig.first_stage_weight"},
        "rerank's null reads the weight the model directory was trained with (its card)",
    ),
}


def leaves(node: dict, prefix: str = "") -> dict:
    """A nested mapping as {dotted key: value} (an empty mapping is a value)."""
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            flat.update(leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def schema_leaves(node) -> dict:
    return leaves(OmegaConf.to_container(OmegaConf.structured(node), enum_to_str=True))


def sweeper_schema() -> dict:
    """hydra.sweeper's keys as `hydra/sweeper: lychee_optuna` composes them (its default sampler's node included)."""
    node = OmegaConf.to_container(OmegaConf.structured(LycheeOptunaSweeperConf))
    (sampler,) = [entry["sampler"] for entry in node.pop("defaults")]
    return leaves({**node, "sampler": SAMPLERS[sampler]}, "hydra.sweeper.")


def hydra_defaults() -> dict:
    """hydra.* as Hydra composes it without any config of ours (its output dirs, job and help settings)."""
    GlobalHydra.instance().clear()
    with initialize(version_base="1.3", config_path=None):
        cfg = compose(config_name=None, return_hydra_config=True)
    return leaves(OmegaConf.to_container(cfg.hydra), "hydra.")


def run_schema() -> dict:
    """The run's keys without any conf/ file: RunConfig's, hydra.* as Hydra gives them, hydra.sweeper.* as
    `hydra/sweeper: lychee_optuna` does."""
    return {**schema_leaves(RunConfig), **hydra_defaults(), **sweeper_schema()}


class Conf:
    """A conf/ directory read as files: each one's keys (as the run's dotted keys) and defaults list."""

    def __init__(self, root: Path):
        self.root = root

    def load(self, rel: str) -> tuple[dict, list]:
        """(the file's keys as the run's dotted keys, its defaults list)."""
        path = self.root / f"{rel}.yaml"
        raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
        defaults = raw.pop("defaults", [])
        group = rel.rpartition("/")[0]
        is_global = "# @package _global_" in path.read_text().splitlines()[:2]
        return leaves(raw, "" if is_global or group in ("", *LAYER_GROUPS) else f"{group}."), defaults

    def options(self, group: str) -> list[str]:
        return sorted(f"{group}/{path.stem}" for path in (self.root / group).glob("*.yaml"))

    def group_options(self) -> list[str]:
        return [rel for group in GROUPS for rel in self.options(group)]

    def options_below(self, rel: str) -> list[str]:
        """The files that can come before rel: every group option, and the options of each layer below rel's."""
        group = rel.rpartition("/")[0]
        lower = LAYER_GROUPS[: LAYER_GROUPS.index(group)] if group in LAYER_GROUPS else ()
        return self.group_options() + [other for layer in lower for other in self.options(layer)]

    def parent(self, rel: str) -> str | None:
        """The option of the same group that rel builds on (a plain name in its defaults list)."""
        group = rel.rpartition("/")[0]
        parents = [entry for entry in self.load(rel)[1] if isinstance(entry, str) and entry != "_self_"]
        return f"{group}/{parents[0]}" if group and parents else None

    def picks(self, rel: str) -> dict:
        """The group choices a file's defaults list makes: {group: option}."""
        found = {}
        for entry in self.load(rel)[1]:
            if isinstance(entry, dict):
                for key, value in entry.items():
                    found[key.removeprefix("override ").removeprefix("optional ").strip().lstrip("/")] = value
        return found

    def default_picks(self) -> dict:
        """What conf/config.yaml picks, and the sweeper's own default sampler."""
        node = OmegaConf.to_container(OmegaConf.structured(LycheeOptunaSweeperConf))
        return {**self.picks("config"), **{f"hydra/sweeper/{k}": v for e in node["defaults"] for k, v in e.items()}}


def group_option_problems(conf: Conf, rel: str, schema: dict) -> list[str]:
    """A group option's keys that restate its parent's value or, without one, the schema's."""
    parent = conf.parent(rel)
    below = conf.load(parent)[0] if parent else {}
    problems = []
    for key, value in conf.load(rel)[0].items():
        before = below.get(key, schema.get(key, MISSING))
        if key.rpartition(".")[2] in IDENTITY_KEYS and value == rel.rpartition("/")[2]:
            continue
        if value == before:
            problems.append(f"{rel}.yaml: {key}: {value!r} restates the value it has without it")
    return problems + pick_problems(conf, rel)


def writings_below(conf: Conf, rel: str) -> dict[str, list]:
    """Every value a key can have below the layer rel, by the files that can precede it (not the schema)."""
    found: dict[str, list] = {}
    for other in conf.options_below(rel) + ["config"] * (rel.rpartition("/")[0] == "hparams_search"):
        for key, value in conf.load(other)[0].items():
            found.setdefault(key, []).append(value)
    return found


def layer_problems(conf: Conf, rel: str, schema: dict) -> list[str]:
    """A layer's keys that every layer below writes alike, and its picks that name what is picked anyway."""
    parent = conf.parent(rel)
    own, parents = conf.load(rel)[0], conf.load(parent)[0] if parent else {}
    config_own = conf.load("config")[0] if rel != "config" else {}
    below = writings_below(conf, rel) if rel.rpartition("/")[0] in LAYER_GROUPS else {}
    problems = []
    for key, value in own.items():
        if key in parents:
            values = [parents[key]]
        elif key.startswith("hydra.") and key in config_own:
            values = [config_own[key]]
        else:
            values = [schema.get(key, MISSING), *below.get(key, [])]
        if all(other == value for other in values):
            problems.append(f"{rel}.yaml: {key}: {value!r} restates the value it has without it")
    return problems + (pick_problems(conf, rel) if rel != "config" else [])


def pick_problems(conf: Conf, rel: str) -> list[str]:
    """A file's `override /group: option` picks that name what is picked without them: by conf/config.yaml (or the
    sweeper's defaults), a parent, and every option below that picks for another group (data=beir's model)."""
    parent, below = conf.parent(rel), conf.options_below(rel)
    pickers = [conf.default_picks()] + [conf.picks(p) for p in [parent] if p]
    pickers += [conf.picks(other) for other in below if other != rel]
    problems = []
    for picked, option in conf.picks(rel).items():
        elsewhere = [picks[picked] for picks in pickers if picked in picks]
        if elsewhere and all(other == option for other in elsewhere):
            problems.append(f"{rel}.yaml: override /{picked}: {option} restates the pick it has without it")
    return problems


def command_problems(conf: Conf, name: str) -> list[str]:
    """mine.yaml's and rerank.yaml's own keys against their schema and the options of the groups they compose."""
    schema = schema_leaves(COMMANDS[name])
    below: dict[str, list] = {}
    for group in conf.picks(name):
        for rel in conf.options(group):
            for key, value in conf.load(rel)[0].items():
                below.setdefault(key, []).append(value)
    own = conf.load(name)[0]
    return [
        f"{name}.yaml: {key}: {value!r} restates the value it has without it"
        for key, value in own.items()
        if all(other == value for other in [schema.get(key, MISSING), *below.get(key, [])])
    ]


def problems_in(conf: Conf, group: str) -> list[str]:
    """The second writings of a group's files ("commands": conf/config.yaml's own keys, mine.yaml, rerank.yaml)."""
    schema = run_schema()
    if group in GROUPS:
        return [p for rel in conf.options(group) for p in group_option_problems(conf, rel, schema)]
    if group in LAYER_GROUPS:
        return [p for rel in conf.options(group) for p in layer_problems(conf, rel, schema)]
    return layer_problems(conf, "config", schema) + [p for name in COMMANDS for p in command_problems(conf, name)]


def all_problems(root: Path) -> list[str]:
    return [problem for group in [*GROUPS, *LAYER_GROUPS, "commands"] for problem in problems_in(Conf(root), group)]


@pytest.mark.parametrize("group", [*GROUPS, *LAYER_GROUPS, "commands"])
def test_conf_writes_each_default_once(group):
    assert problems_in(Conf(CONF), group) == []


# (file, what is planted in it, the second writings it must be caught as)
PLANTED = [
    # a group option restating the schema (its other key differs), and its child restating it
    ("trainer/default", "log_every: 10\neval_every: 7\n", ["trainer/default.yaml: trainer.log_every: 10 "]),
    ("trainer/quick", "eval_every: 7\n", ["trainer/quick.yaml: trainer.eval_every: 7 "]),
    # a model's recipe restating the schema
    (
        "model_recipe/minilm_bi_encoder",
        "optimizer:\n  warmup_ratio: 0.1\n",
        ["minilm_bi_encoder.yaml: optimizer.warmup_ratio: 0.1 "],
    ),
    # a preset restating what every group option leaves to the schema
    ("experiment/quickstart", "optimizer:\n  warmup_ratio: 0.1\n", ["quickstart.yaml: optimizer.warmup_ratio: 0.1 "]),
    # a preset picking what conf/config.yaml picks
    (
        "experiment/tiny_smoke",
        "defaults:\n  - override /trainer: quick\n",
        ["tiny_smoke.yaml: override /trainer: quick "],
    ),
    # a search restating its parent's direction and the sweeper's n_jobs
    (
        "hparams_search/lr_tokens",
        "hydra:\n  sweeper:\n    direction: maximize\n    n_jobs: 1\n",
        ["lr_tokens.yaml: hydra.sweeper.direction: 'maximize' ", "lr_tokens.yaml: hydra.sweeper.n_jobs: 1 "],
    ),
    # a command restating its schema
    ("rerank", "top_k: 100\n", ["rerank.yaml: top_k: 100 "]),
]


def plant(path: Path, text: str) -> None:
    """Merges text into a conf/ file, its header comments (the package line) kept."""
    header = list(itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines()))
    merged = OmegaConf.to_container(OmegaConf.load(path)) or {}
    planted = OmegaConf.to_container(OmegaConf.create(text))
    merged["defaults"] = merged.get("defaults", []) + planted.pop("defaults", [])
    merged = OmegaConf.to_container(OmegaConf.merge({k: v for k, v in merged.items() if v != []}, planted))
    path.write_text("\n".join(header + [OmegaConf.to_yaml(merged)]))


def test_the_rule_catches_each_kind_of_second_writing(tmp_path):
    root = tmp_path / "conf"
    shutil.copytree(CONF, root)
    assert all_problems(root) == []  # the copy as it is
    for rel, text, _ in PLANTED:
        plant(root / f"{rel}.yaml", text)
    problems = all_problems(root)
    expected = [line for _, _, lines in PLANTED for line in lines]
    assert len(problems) == len(expected), problems
    for line in expected:
        assert any(problem.startswith(line) or f"/{line}" in problem for problem in problems), (line, problems)


def test_a_layer_may_restate_what_an_option_below_changes(tmp_path):
    """mine.yaml's model.random_init=false equals the schema's, but model=tiny_lychee sets true: it is needed."""
    conf = Conf(CONF)
    assert conf.load("mine")[0]["model.random_init"] is False
    assert command_problems(conf, "mine") == []
    root = tmp_path / "conf"
    shutil.copytree(CONF, root)
    (root / "model" / "tiny_lychee.yaml").write_text("name: tiny_lychee\npath: x\n")
    assert command_problems(Conf(root), "mine") == [
        "mine.yaml: model.random_init: False restates the value it has without it"
    ]


# ------------------------------------------------------------------------------------------ the schemas' keys
def schema_classes() -> list[type]:
    """Every dataclass the registered schemas are built from."""
    found, todo = [], [RunConfig, MineConfig, RerankConfig, LycheeOptunaSweeperConf]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            hints = typing.get_type_hints(cls)
            todo += [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return found


def declarations(classes: list[type]) -> dict[str, set[str]]:
    """{key name: the declarations (owner.field) of the keys of that name that have a default}."""
    found: dict[str, set[str]] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING or f.default == MISSING:
                continue
            found.setdefault(f.name, set()).add(f.metadata.get(DECLARED_IN, f"{cls.__name__}.{f.name}"))
    return found


def duplicate_declarations(classes: list[type]) -> dict[str, set[str]]:
    return {name: owners for name, owners in declarations(classes).items() if len(owners) > 1}


def test_each_schema_key_is_declared_once():
    found = duplicate_declarations(schema_classes())
    assert {name: owners for name, owners in found.items() if DIFFERENT_SETTINGS.get(name, ((),))[0] != owners} == {}
    assert set(found) == set(DIFFERENT_SETTINGS)  # no entry outlives its reason


def test_a_shared_key_keeps_its_owners_type_default_and_bounds():
    for cls in schema_classes():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if DECLARED_IN not in f.metadata:
                continue
            owner_name, name = f.metadata[DECLARED_IN].split(".")
            (owner,) = [c for c in schema_classes() if c.__name__ == owner_name]
            source = {g.name: g for g in dataclasses.fields(owner)}[name]
            assert hints[f.name] == typing.get_type_hints(owner)[name], f"{cls.__name__}.{f.name}"
            assert (f.default, f.default_factory) == (source.default, source.default_factory)
            assert {k: v for k, v in f.metadata.items() if k != DECLARED_IN} == dict(source.metadata)


def test_the_schema_rule_catches_a_second_declaration():
    @dataclasses.dataclass
    class Owner:
        first_stage: str = "bm25"

    @dataclasses.dataclass
    class Again:
        first_stage: str = "bm25"

    @dataclasses.dataclass
    class Shared:
        first_stage: str = declared_in(Owner, "first_stage")

    assert duplicate_declarations([Owner, Again]) == {"first_stage": {"Owner.first_stage", "Again.first_stage"}}
    assert duplicate_declarations([Owner, Shared]) == {}
    assert Shared().first_stage == "bm25"


# ------------------------------------------------------------------------- what docs/configuration.md states
DOC = REPO / "docs" / "configuration.md"
TABLE = re.compile(r"<!-- docs-test: default-run -->\n((?:\|.*\n)+)")


def doc_rows(text: str) -> list[tuple[str, object, str]]:
    """(key, value, where it comes from) for each row of docs/configuration.md's table of the default run."""
    (table,) = TABLE.findall(text)
    rows = []
    for line in table.splitlines()[2:]:
        key, value, origin = (cell.strip().strip("`") for cell in line.strip("|").split("|")[:3])
        rows.append((key, OmegaConf.create(f"v: {value}").v, origin))
    return rows


def default_run() -> tuple[dict, Conf, list[str]]:
    """The default run's composed keys and its layers, lowest first (the schema below them): conf/config.yaml's
    defaults list with each group's final choice (a parent option before its child), then its own keys."""
    register_config()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR, job_name="run"):
        cfg = compose(config_name="config", return_hydra_config=True)
    conf, choices = Conf(CONF), cfg.hydra.runtime.choices
    layers = []
    for group in conf.picks("config"):
        rel = f"{group}/{choices.get(group)}"
        if (CONF / f"{rel}.yaml").is_file():  # an optional pick (model_recipe) may have no file
            layers += [p for p in [conf.parent(rel)] if p] + [rel]
    job = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    return leaves(OmegaConf.to_container(job, enum_to_str=True)), conf, layers + ["config"]


def doc_problems(text: str) -> list[str]:
    """Where the table's value or origin is not the default run's."""
    job, conf, layers = default_run()
    problems = []
    for key, value, origin in doc_rows(text):
        writers = [rel for rel in layers if key in conf.load(rel)[0]]
        got = f"conf/{writers[-1]}.yaml" if writers else "schema"
        if job[key] != value or origin != got:
            problems.append(f"{key}: the default run gets {job[key]!r} from {got}, not {value!r} from {origin}")
    return problems


def test_docs_state_what_the_default_run_gets():
    text = DOC.read_text()
    assert {"trainer.max_steps", "data.train_group_size", "data.teacher_weight"} <= {k for k, _, _ in doc_rows(text)}
    assert doc_problems(text) == []


def test_the_docs_check_catches_a_wrong_value_and_a_wrong_origin():
    text = DOC.read_text()
    wrong = text.replace("| `trainer.max_steps` | `120` |", "| `trainer.max_steps` | `45` |")
    wrong = wrong.replace(
        "| `data.teacher_weight` | `0.7` | `conf/data/sample.yaml` |", "| `data.teacher_weight` | `0.7` | `schema` |"
    )
    assert [problem.split(":")[0] for problem in doc_problems(wrong)] == ["data.teacher_weight", "trainer.max_steps"]


def test_docs_layering_example_names_each_layers_value():
    """The paragraph above the table follows trainer.max_steps through the layers: its numbers are the files'."""
    found = re.search(
        r"`trainer\.max_steps` is (-?\d+) in the schema .*?, (\d+) in\s+`trainer=quick` .*? and (\d+) in\s+"
        r"`experiment=quickstart`",
        DOC.read_text(),
        re.S,
    )
    conf = Conf(CONF)
    layers = [
        RunConfig().trainer.max_steps,
        conf.load("trainer/quick")[0]["trainer.max_steps"],
        conf.load("experiment/quickstart")[0]["trainer.max_steps"],
    ]
    assert found and [int(n) for n in found.groups()] == layers, layers
