"""What a model trains with follows the model, whichever data group it trains on. A model's own training settings,
where they differ from the groups' (the bi-encoder's fine-tuning lr), live in conf/model_recipe/<model>.yaml, which
conf/config.yaml picks for the chosen model over every group and under an experiment and the command line; a data
group writes data keys only. docs/configuration.md's table of each model's recipe is checked against every shipped
model composed with every shipped data group."""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from test_defaults import Conf, leaves, plant

from lychee_exp.config.schema import CONF_DIR
from lychee_exp.job.context import register_config

CONF = Path(CONF_DIR)
DOC = CONF.parent / "docs" / "configuration.md"
TABLE = re.compile(r"<!-- docs-test: model-recipes -->\n((?:\|.*\n)+)")
# with the default preset (experiment=quickstart) and without any (~experiment): neither writes a recipe's key
PRESETS = ([], ["~experiment"])


def composed(overrides_list: list[list[str]], conf_dir: Path = CONF) -> list[dict]:
    """Each override list composed as `python -m lychee_exp.run` does, as {dotted key: value} (hydra.* left out)."""
    register_config()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir), job_name="run"):
        cfgs = [compose(config_name="config", overrides=overrides) for overrides in overrides_list]
    GlobalHydra.instance().clear()
    return [leaves(OmegaConf.to_container(cfg, enum_to_str=True)) for cfg in cfgs]


def doc_recipes(text: str) -> dict[str, tuple[dict, str]]:
    """{model: ({key: value}, where the values come from)} from docs/configuration.md's table of each model's
    recipe: a row per model, a column per key between the model and the `from` column."""
    (table,) = TABLE.findall(text)
    header, _, *rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")] for line in table.splitlines()
    ]
    keys = header[1 : header.index("from")]
    recipes = {}
    for row in rows:
        values = {key: OmegaConf.create(f"v: {value}").v for key, value in zip(keys, row[1:])}
        recipes[row[0]] = (values, row[1 + len(keys)])
    return recipes


def recipe_problems(text: str, conf_dir: Path = CONF) -> list[str]:
    """Where a model composed with a data group (under each preset) does not get the recipe the table states, or
    the table's origin is not the file that writes the key."""
    conf, recipes = Conf(conf_dir), doc_recipes(text)
    models = [rel.partition("/")[2] for rel in conf.options("model")]
    problems = [f"{model}: shipped, but the table has no row for it" for model in models if model not in recipes]
    combos = list(itertools.product(sorted(recipes), [rel.partition("/")[2] for rel in conf.options("data")], PRESETS))
    runs = [[f"model={model}", f"data={data}", *preset] for model, data, preset in combos]
    for run, (model, *_), job in zip(runs, combos, composed(runs, conf_dir)):
        for key, value in recipes[model][0].items():
            if job[key] != value:
                problems.append(f"{' '.join(run)}: {key} is {job[key]!r}, not {value!r}")
    for model, (values, origin) in recipes.items():
        own = conf.load(f"model_recipe/{model}")[0] if (conf_dir / "model_recipe" / f"{model}.yaml").is_file() else {}
        for key in values:
            got = f"conf/model_recipe/{model}.yaml" if key in own else "schema"
            if origin != got:
                problems.append(f"{model}: {key} comes from {got}, not {origin}")
    return problems


def test_every_model_gets_its_own_recipe_on_every_data_group():
    text = DOC.read_text()
    assert {"minilm_cross_encoder", "minilm_bi_encoder"} <= set(doc_recipes(text))
    assert recipe_problems(text) == []


def test_the_recipe_check_catches_a_data_group_that_sets_a_models_lr(tmp_path):
    """conf/data/beir.yaml set optimizer.lr=1e-5 (the bi-encoder's) for every model: the cross-encoder, offered
    there, trained at 1e-5 and ended below BM25."""
    root = tmp_path / "conf"
    shutil.copytree(CONF, root)
    plant(root / "data" / "beir.yaml", "optimizer:\n  lr: 1.0e-5\n")
    problems = recipe_problems(DOC.read_text(), root)
    others = [model for model in doc_recipes(DOC.read_text()) if model != "minilm_bi_encoder"]
    expected = {" ".join([f"model={model}", "data=beir", *preset]) for model in others for preset in PRESETS}
    assert {problem.split(":")[0] for problem in problems} == expected, problems


def test_a_data_group_writes_data_keys_only():
    conf = Conf(CONF)
    written = {rel: sorted(conf.load(rel)[0]) for rel in conf.options("data")}
    assert {rel: [k for k in keys if not k.startswith("data.")] for rel, keys in written.items()} == {
        rel: [] for rel in written
    }


def test_each_recipe_file_is_a_shipped_models_and_leaves_the_model_to_its_preset():
    """The pick is optional (most models have no recipe), so a misnamed file would never apply: each names a model.
    A recipe's model.* key belongs in the model's own conf/model/<model>.yaml."""
    conf = Conf(CONF)
    models = {rel.partition("/")[2] for rel in conf.options("model")}
    recipes = conf.options("model_recipe")
    assert recipes and {rel.partition("/")[2] for rel in recipes} <= models
    assert [key for rel in recipes for key in conf.load(rel)[0] if key.startswith("model.")] == []


def test_command_line_over_experiment_over_recipe_over_groups(tmp_path):
    root = tmp_path / "conf"
    shutil.copytree(CONF, root)
    plant(root / "data" / "beir.yaml", "optimizer:\n  lr: 7.0e-5\n")  # a group that sets the lr anyway
    smoke_lr = Conf(CONF).load("experiment/tiny_smoke")[0]["optimizer.lr"]
    recipe_lr = Conf(CONF).load("model_recipe/minilm_bi_encoder")[0]["optimizer.lr"]
    jobs = composed(
        [
            ["data=beir"],  # data=beir picks the bi-encoder
            ["data=beir", "model=minilm_cross_encoder"],
            ["data=beir", "experiment=tiny_smoke", "model=minilm_bi_encoder"],
            ["data=beir", "experiment=tiny_smoke", "model=minilm_bi_encoder", "optimizer.lr=3e-5"],
        ],
        root,
    )
    assert jobs[0]["model.name"] == "minilm_bi_encoder"
    assert [job["optimizer.lr"] for job in jobs] == [recipe_lr, 7e-5, smoke_lr, 3e-5]


def test_a_search_on_data_beir_starts_from_the_bi_encoders_recipe():
    """hparams_search=recipe picks data=beir (so its bi-encoder): the lr it composes, before the sweeper's
    searched value, is the bi-encoder's; other models keep theirs under it."""
    recipe_lr = Conf(CONF).load("model_recipe/minilm_bi_encoder")[0]["optimizer.lr"]
    search, cross = composed([["hparams_search=recipe"], ["hparams_search=recipe", "model=minilm_cross_encoder"]])
    assert (search["model.name"], search["optimizer.lr"]) == ("minilm_bi_encoder", recipe_lr)
    assert cross["optimizer.lr"] == doc_recipes(DOC.read_text())["minilm_cross_encoder"][0]["optimizer.lr"]
