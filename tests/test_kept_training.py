"""No run loses its training: the model and the last step's checkpoint are written before the final dev evaluation,
so that a run killed by SIGKILL in that evaluation leaves a loadable model/ and resumes to just the evaluation,
ending with the figures of a run that was never interrupted; runs checkpoint by default (trainer.checkpoint_every
=auto) at an interval measured from their own write and step times."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import TINY_OVERRIDES, run_cli, run_metrics, run_tiny
from safetensors.torch import load_file
from test_model_card import rerank_cfg
from transformers import AutoModelForCausalLM

from lychee_exp.errors import UserError
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer
from lychee_exp.train.checkpoint import latest_checkpoint
from lychee_exp.train.checkpoint_schedule import FIRST_AUTO_STEPS, CheckpointSchedule, measured_interval

STEPS = 4
FIGURES = ("ndcg@10", "mrr@10", "model_ndcg@10", "model_mrr@10", "initial_ndcg@10", "train_loss")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """An uninterrupted run, and the same run killed (SIGKILL) in its final evaluation, before and after resuming."""
    root = tmp_path_factory.mktemp("kept")
    reference, killed = root / "reference", root / "killed"
    assert run_cli(TINY_OVERRIDES, reference).returncode == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LYCHEE_FAULT", f"0:{STEPS}:kill_in_eval")  # SIGKILL at the final evaluation's first forward
        kill = run_cli(TINY_OVERRIDES, killed)
    state = {
        "kill": kill,
        "files": sorted(p.name for p in killed.iterdir()),
        "card": (killed / "model" / "README.md").read_text(),
        "weights": load_file(str(killed / "model" / "model.safetensors")),
        "checkpoint": latest_checkpoint(killed),
    }
    state["resume"] = run_cli([*TINY_OVERRIDES, "trainer.resume=auto"], killed)
    return {"reference": reference, "killed": killed, **state}


def test_a_run_killed_in_its_final_evaluation_keeps_a_loadable_model(runs):
    assert runs["kill"].returncode == -9, runs["kill"].stderr[-2000:]  # the run's one process: SIGKILL
    assert "kill_in_eval fired" in runs["kill"].stderr and "training done at step 4" in runs["kill"].stdout
    assert "metrics.json" not in runs["files"] and "model" in runs["files"]
    # the card names what it holds, and no dev figures it does not have
    assert "before the run's final dev evaluation" in runs["card"] and "| this model alone |" not in runs["card"]
    assert f"- steps: {STEPS}" in runs["card"]
    # the trained weights: the uninterrupted run's, loadable as users load them
    reference = load_file(str(runs["reference"] / "model" / "model.safetensors"))
    assert runs["weights"].keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(runs["weights"][name], tensor, atol=0, rtol=0)
    model_dir = runs["killed"] / "model"
    cfg = rerank_cfg("model=tiny_lychee", f"model.path={model_dir}").model
    reranker = load_reranker(cfg, build_encoder(cfg, load_tokenizer(cfg)), seed=0)
    name = next(n for n in reference if n.endswith("q_proj.weight"))
    torch.testing.assert_close(reranker.backbone.state_dict()[name], reference[name], atol=0, rtol=0)
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.num_hidden_layers > 0


def test_the_killed_run_leaves_its_last_step_checkpointed(runs):
    assert runs["checkpoint"] is not None and runs["checkpoint"].name == f"step_{STEPS:06d}"
    assert (runs["checkpoint"] / "state.pt").is_file() and (runs["checkpoint"] / "model.safetensors").is_file()


def test_resuming_runs_the_final_evaluation_only_and_ends_as_the_uninterrupted_run(runs):
    resume = runs["resume"]
    assert resume.returncode == 0, resume.stderr[-2000:]
    said = resume.stdout + resume.stderr
    assert f"resumed from {runs['checkpoint']} at step {STEPS}" in said
    assert f"step 1/{STEPS}" not in said  # nothing trained again
    ref, res = run_metrics(runs["reference"]), run_metrics(runs["killed"])
    for key in FIGURES:
        assert res[key] == pytest.approx(ref[key], abs=1e-6), key
    assert res["steps"] == STEPS and (res["steps_this_run"], ref["steps_this_run"]) == (0, STEPS)
    assert f"resumed at its last step, {STEPS}: nothing trained again, the final evaluation ran" in said
    # the card now holds the evaluation's figures, as the uninterrupted run's does
    card = (runs["killed"] / "model" / "README.md").read_text()
    assert card == (runs["reference"] / "model" / "README.md").read_text()


def test_the_uninterrupted_run_checkpoints_its_last_step_by_default(runs):
    ref = runs["reference"]
    assert json.loads((ref / "model" / "lychee_reranker.json").read_text())["kind"] == "causal_lm"
    assert [p.name for p in (ref / "checkpoints").glob("step_*")] == [f"step_{STEPS:06d}"]
    assert "| this model alone |" in (ref / "model" / "README.md").read_text()


def test_auto_checkpoints_keep_their_writing_under_two_percent_of_training():
    assert measured_interval(write_s=1.0, step_s=1.0) == 50  # 1 s every 50 s of 1 s steps: 2%
    assert measured_interval(write_s=12.2, step_s=1.3) == 470  # LoRA r=64 (0.89 GB) on a slow disk, 1.3 s steps
    assert measured_interval(write_s=0.01, step_s=5.0) == 1
    schedule, written = CheckpointSchedule("auto", start=0, total_steps=100), []
    for step in range(1, 101):
        if schedule.due(step):
            written.append(step)
            schedule.written(step, interval=7 if step < 50 else 30)  # the interval each write measured
    assert written == [FIRST_AUTO_STEPS, 17, 24, 31, 38, 45, 52, 82, 100]  # and the last step, whatever the interval
    assert CheckpointSchedule("auto", start=40, total_steps=100).due(40 + FIRST_AUTO_STEPS)  # a resumed run
    fixed = CheckpointSchedule(3, start=0, total_steps=10)
    assert [s for s in range(1, 11) if fixed.due(s)] == [3, 6, 9, 10]
    assert not any(CheckpointSchedule(0, 0, 10).due(s) for s in range(1, 11))
    with pytest.raises(UserError, match="checkpoint_every must be auto or an integer >= 0"):
        CheckpointSchedule("sometimes", 0, 10)


def test_auto_checkpoints_after_its_first_steps_and_at_the_last(tmp_path, caplog):
    """auto: the first checkpoint after FIRST_AUTO_STEPS steps, its write and step times logged with the interval
    they give, and the last step's; the newest keep_checkpoints (2) stay."""
    caplog.set_level("INFO", logger="lychee_exp.train.trainer")
    steps = FIRST_AUTO_STEPS + 2
    run_tiny(tmp_path, f"trainer.max_steps={steps}", "trainer.evaluate=false")
    written = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint: ")]
    names = [f"step_{FIRST_AUTO_STEPS:06d}", f"step_{steps:06d}"]
    assert [line.split()[1].rsplit("/", 1)[-1] for line in written] == names, written
    assert re.search(r"\(written in \d+\.\d\d s, steps \d+\.\d\d s; auto: the next in \d+ steps?\)", written[0])
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == names
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == names[-1]
