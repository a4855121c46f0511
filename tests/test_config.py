"""Every config group option composes and passes the schema + value checks; mistakes fail naming the key."""

from __future__ import annotations

import sys

import pytest
from conftest import CONF_DIR, compose_config, output_lines, run_cli
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lychee_exp.cli import composition_error
from lychee_exp.config import choices
from lychee_exp.config.schema import Choice, RunConfig, check_config, to_run_config
from lychee_exp.errors import UserError
from lychee_exp.job.training_job import preflight
from lychee_exp.run import main

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
    if group in ("model", "data"):
        assert cfg[group].name == option
    if group == "loss":  # a loss option is a registered loss, or a preset of one named <loss>_<variant>
        assert option == cfg.loss.name or option.startswith(f"{cfg.loss.name}_")
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
    # token-budget packed batches: one shape per run (benchmarks/padded_vs_packed.py, docs/performance.md)
    assert run_cfg.data.packing and run_cfg.data.max_tokens_per_batch == 16384


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


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["optimizer.lr=0"], "optimizer.lr"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["data.batch_size=0"], "data.batch_size"),
        (["loss=listwise", "data.train_group_size=1"], "data.train_group_size"),
        (["model.prompt.template='Instruct: {instruction} Query: {query}'"], "model.prompt.template"),
        (["optimizer.warmup_ratio=1.0"], "optimizer.warmup_ratio"),
        (["loss.temperature=0"], "loss.temperature"),
        (["model.prompt.template='{query} {document} {oops}'"], "model.prompt.template"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_impossible_values_give_user_error_naming_key(overrides, key, tmp_path):
    cfg = compose_config(["model=tiny_lychee", *overrides], tmp_path)
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        to_run_config(cfg)
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        check_config(cfg)  # the DictConfig path of the same checks


def test_pointwise_allows_group_size_one(tmp_path):
    run_cfg = to_run_config(
        compose_config(["model=tiny_lychee", "loss=pointwise", "data.train_group_size=1"], tmp_path)
    )
    assert run_cfg.data.train_group_size == 1


def test_template_check_does_not_depend_on_text_around_fields(tmp_path):
    cfg = compose_config(["model=tiny_lychee", "model.prompt.template='Q={query}; D={document}. Relevant?'"], tmp_path)
    assert to_run_config(cfg).model.prompt.template.endswith("Relevant?")


def test_composed_config_round_trips_to_yaml(tmp_path):
    run_cfg = to_run_config(compose_config(["model=tiny_lychee"], tmp_path))
    again = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(RunConfig), OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(run_cfg)))
        )
    )
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


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        ("trainer.precision=fp8", "[auto, fp32, bf16, fp16]"),
        ("optimized_metric=map", "[model_ndcg@10, model_mrr@10, ndcg@10, mrr@10]"),
        ("parallel.strategy=zero3", "[single, dp, ddp, fsdp]"),
        ("optimizer.lr_scaling=cubic", "[none, linear, sqrt]"),
        ("model.kind=seq2seq", "[causal_lm, sequence_classification, bi_encoder]"),
    ],
)
def test_closed_choice_fails_at_compose_naming_key_and_choices(override, allowed, compose_cfg, tmp_path):
    key = override.split("=")[0]
    with pytest.raises(ConfigCompositionException) as caught:
        compose_cfg([override], tmp_path)
    cause = caught.value.__cause__
    assert cause.full_key == key and allowed in str(cause)


def test_choice_names_are_the_values_users_write():
    """OmegaConf matches a choice by member name, and code compares members with strings: both must agree."""
    enums = [v for v in vars(choices).values() if isinstance(v, type) and issubclass(v, Choice) and v is not Choice]
    assert len(enums) >= 10
    for enum in enums:
        for member in enum:
            assert member.name == member.value == str(member) == f"{member}", member


def test_bounds_live_beside_their_fields(tmp_path):
    """Every numeric field that must be positive fails naming its key (no separate list to keep in step)."""
    for override, key in [
        ("data.eval_batch_size=0", "data.eval_batch_size"),
        ("parallel.timeout_s=0", "parallel.timeout_s"),
        ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints"),
        ("trainer.grad_accum_steps=0", "trainer.grad_accum_steps"),
    ]:
        with pytest.raises(UserError, match=rf"^{key.replace('.', '[.]')} must be >= "):
            to_run_config(compose_config(["model=tiny_lychee", override], tmp_path))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loss.name=hinge", "loss.name='hinge' is not one of listwise, pointwise"),
        ("optimizer.name=lion", "optimizer.name='lion' is not one of adamw, sgd"),
    ],
)
def test_unregistered_part_fails_before_training_listing_the_registered(override, message, tmp_path):
    run_cfg = to_run_config(compose_config(["model=tiny_lychee", override], tmp_path))
    with pytest.raises(UserError) as caught:
        preflight(run_cfg)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.precision=fp8", "trainer.precision: Invalid value 'fp8', expected one of [auto, fp32, bf16, fp16]"),
        ("optimizer.lrr=1", "optimizer.lrr: Key 'lrr' not in 'OptimizerConfig'"),
        ("loss=hinge", "loss=hinge: no such option in conf/loss; options: listwise, listwise_distill, pointwise"),
    ],
)
def test_config_that_does_not_compose_reads_as_one_line(override, expected, compose_cfg, tmp_path):
    with pytest.raises(ConfigCompositionException) as caught:
        compose_cfg([override], tmp_path)
    assert composition_error(caught.value) == expected


def test_cli_config_that_does_not_compose_is_one_line_exit_2(tmp_path, monkeypatch, capfd):
    """The CLI's main() as `python -m lychee_exp.run trainer.precision=fp8` calls it (in this process: the
    subprocess path is test_cli_bad_value_is_one_line_exit_2's)."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["lychee-run", "trainer.precision=fp8", f"hydra.run.dir={run_dir}"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # main() sets it; monkeypatch restores it afterwards
    with pytest.raises(SystemExit) as caught:
        main()
    out, err = capfd.readouterr()
    assert caught.value.code == 2
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert lines == ["error: trainer.precision: Invalid value 'fp8', expected one of [auto, fp32, bf16, fp16]"]
    assert not run_dir.exists()
