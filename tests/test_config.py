"""Every config group option composes and passes the schema + value checks; mistakes fail naming the key."""
from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose_config, output_lines, run_cli
from lychee_exp.config import RunConfig, check_config, to_run_config
from lychee_exp.errors import UserError

GROUPS = ["model", "data", "loss", "optimizer", "trainer", "parallel", "logger", "experiment"]
# Options whose required paths are the user's own: they get placeholders, so only compose + check_config.
NEEDS_PATHS = {
    ("model", "lychee_rerank"): ["model.path=/models/lychee-rerank"],
    ("model", "qwen3_reranker"): ["model.path=/models/qwen3-reranker"],
    ("model", "bge_reranker_gemma"): ["model.path=/models/bge-reranker-v2-gemma"],
    ("data", "jsonl"): ["data.train_file=/data/train.jsonl", "data.dev_file=/data/dev.jsonl"],
    ("experiment", "lychee_lora"): ["model.path=/models/lychee-rerank"],
}


def _options():
    for group in GROUPS:
        names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        assert names, f"conf/{group} has no options"
        for name in names:
            yield group, name


@pytest.mark.parametrize(("group", "option"), list(_options()), ids=lambda v: str(v))
def test_every_option_composes_and_checks(group, option, tmp_path):
    overrides = [f"{group}={option}", *NEEDS_PATHS.get((group, option), [])]
    cfg = compose_config(overrides, tmp_path)
    if group in ("model", "data", "loss"):
        assert cfg[group].name == option
    if (group, option) in NEEDS_PATHS:
        check_config(cfg)
        # Paths are resolved later (preflight), so the typed config is still produced.
        assert isinstance(to_run_config(cfg), RunConfig)
        return
    run_cfg = to_run_config(cfg)
    assert isinstance(run_cfg, RunConfig)
    assert run_cfg.output_dir == str(tmp_path)


def test_experiment_tiny_smoke_selects_tiny_model(tmp_path):
    run_cfg = to_run_config(compose_config(["experiment=tiny_smoke"], tmp_path))
    assert run_cfg.model.name == "tiny_lychee"
    assert run_cfg.trainer.max_steps == 8


def test_experiment_lychee_lora_recipe(tmp_path):
    run_cfg = to_run_config(compose_config(["experiment=lychee_lora", "model.path=/m"], tmp_path))
    assert run_cfg.model.lora.enabled and run_cfg.model.lora.r == 64 and run_cfg.model.lora.alpha == 32
    assert run_cfg.optimizer.lr == pytest.approx(1e-4)
    assert run_cfg.data.train_group_size == 16


def test_misspelt_key_fails_at_compose_naming_it(compose_cfg, tmp_path):
    with pytest.raises(ConfigCompositionException, match=r"optimizer\.lrr"):
        compose_cfg(["optimizer.lrr=1"], tmp_path)


def test_wrong_type_fails_at_compose_naming_it(compose_cfg, tmp_path):
    with pytest.raises(ConfigCompositionException, match=r"data\.batch_size"):
        compose_cfg(["data.batch_size=abc"], tmp_path)


def test_tiny_fixture_config(tiny_cfg, tmp_path):
    run_cfg = to_run_config(tiny_cfg)
    assert run_cfg.model.name == "tiny_lychee" and run_cfg.model.kind == "causal_lm" and run_cfg.model.random_init
    assert run_cfg.trainer.max_steps == 4 and not run_cfg.trainer.progress_bar
    assert run_cfg.logger.name == "none" and run_cfg.parallel.strategy == "single"
    assert run_cfg.output_dir == str(tmp_path)


@pytest.mark.parametrize(("overrides", "key"), [
    (["optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.lr=-1"], "optimizer.lr"),
    (["data.batch_size=0"], "data.batch_size"),
    (["loss=listwise", "data.train_group_size=1"], "data.train_group_size"),
    (["trainer.precision=fp8"], "trainer.precision"),
    (["model.prompt.template='Instruct: {instruction} Query: {query}'"], "model.prompt.template"),
    (["optimizer.warmup_ratio=1.0"], "optimizer.warmup_ratio"),
    (["loss.temperature=0"], "loss.temperature"),
    (["optimized_metric=map"], "optimized_metric"),
    (["model.prompt.template='{query} {document} {oops}'"], "model.prompt.template"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_impossible_values_give_user_error_naming_key(overrides, key, tmp_path):
    cfg = compose_config(["model=tiny_lychee", *overrides], tmp_path)
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        to_run_config(cfg)
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        check_config(cfg)  # the DictConfig path of the same checks


def test_pointwise_allows_group_size_one(tmp_path):
    run_cfg = to_run_config(compose_config(["model=tiny_lychee", "data.train_group_size=1"], tmp_path))
    assert run_cfg.data.train_group_size == 1


def test_template_check_does_not_depend_on_text_around_fields(tmp_path):
    cfg = compose_config(["model=tiny_lychee",
                          "model.prompt.template='Q={query}; D={document}. Relevant?'"], tmp_path)
    assert to_run_config(cfg).model.prompt.template.endswith("Relevant?")


def test_composed_config_round_trips_to_yaml(tmp_path):
    run_cfg = to_run_config(compose_config(["model=tiny_lychee"], tmp_path))
    again = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                                OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(run_cfg)))))
    assert again == run_cfg


def test_cli_bad_value_is_one_line_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["optimizer.lr=-1"], run_dir, timeout=120)
    lines = output_lines(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1, lines
    assert "optimizer.lr" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (run_dir / "metrics.json").exists()
