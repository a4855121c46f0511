"""What `python -m lychee_exp.run` (and `mine`, `rerank`) loads before it answers a user mistake: nothing of torch
for a config that does not compose, and none of the training stack (peft, the launcher, the recipe, trackers, the
sweeper) for an input that fails the job's checks. The answers are one line and exit 2 either way; the point is
that they come in seconds, not after the ~10 s of imports a run needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# The training stack: loaded by the launcher and the ranks, never before the checks passed. Adding one of these
# back to the top of run.py, job/training_job.py or a module they import fails test_a_bad_input_...
TRAINING_STACK = {
    "peft",
    "accelerate",
    "torchmetrics",
    "wandb",
    "optuna",
    "transformers.trainer_utils",
    "lychee_exp.launch.launcher",
    "lychee_exp.launch.ranks",
    "lychee_exp.train.trainer",  # the recipe (train.inputs, what preflight reads, is not)
    "lychee_exp.ir.evaluate",
}
# One process answers the mistakes in turn (each an exit 2), reporting after each which of the watched modules it
# holds (so far: the cases that must load least come first): one start instead of four.
PROBE = textwrap.dedent(
    """
    import importlib, json, sys

    watched = set(sys.argv[1].split(","))
    report = {}
    for case, (command, *args) in json.loads(sys.argv[2]).items():
        sys.argv = [command, *args]
        try:
            importlib.import_module(f"lychee_exp.{command}").main()
        except SystemExit as stop:
            report[case] = {"exit": stop.code, "loaded": sorted(m for m in sys.modules if m in watched)}
    print(json.dumps(report))
    """
)


def probe(cases: dict[str, list[str]], watched: set[str], cwd) -> dict:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")  # PYTHONPATH: the repository and tests/ (conftest)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(sorted(watched)), json.dumps(cases)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_user_mistakes_are_answered_without_the_training_stack(tmp_path):
    bad_lines = tmp_path / "train.jsonl"
    bad_lines.write_text('{"query": "q", "pos": ["a"]}\nnot json\n')
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    report = probe(
        {
            "misspelt key": ["run", "optimizer.lrr=1", run_dir],
            "mine, misspelt key": ["mine", "dataset=x", "out=y", "top_kk=3"],
            "rerank, misspelt key": ["rerank", "dataset=x", "out=y", "top_kk=3"],
            "bad data file": ["run", f"data.train_file={bad_lines}", "logger=none", run_dir],
        },
        TRAINING_STACK | {"torch", "transformers", "lychee_exp.job.training_job", "lychee_exp.launch.scoring"},
        tmp_path,
    )
    for case in ("misspelt key", "mine, misspelt key", "rerank, misspelt key"):  # not even torch: nothing composed
        assert report[case] == {"exit": 2, "loaded": []}, case
    bad_file = report["bad data file"]
    assert bad_file["exit"] == 2
    # the job ran its checks (so the probe does see what is loaded); torch (device planning) and transformers'
    # tokenizer (the token budget) may come with them, nothing else watched
    assert set(bad_file["loaded"]) - {"torch", "transformers"} == {"lychee_exp.job.training_job"}, bad_file
