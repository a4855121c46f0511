"""Entry point: `python -m lychee_exp.rerank dataset=<beir dir> split=test first_stage=bm25 top_k=100
model=minilm_cross_encoder model.path=<run dir>/model out=<dir> [parallel=ddp gpus=N]`.

Scores a split's first-stage top-k with a trained run's model/ (or any model preset's weights) and writes
<out>/run.trec (TREC run) and <out>/metrics.json: ndcg@10, mrr@10, recall@<top_k>, map as trec_eval computes
them on run.trec and the split's qrels, the same keys prefixed first_stage_, and pairs/s. Everything a user can
get wrong is checked before any rank starts; a mistake is one line, exit 2. out= is written as core.outputs says:
whole or not at all, never over an input, an earlier result only with overwrite=true; Ctrl-C leaves it as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lychee_exp.core.atomic import write_json_atomic
from lychee_exp.core.devices import plan_devices
from lychee_exp.core.errors import RunFailed, UserError
from lychee_exp.core.ir.config import RerankConfig, check_rerank_config, command_inputs, register_ir_schemas
from lychee_exp.core.ir.first_stage import retrieve
from lychee_exp.core.ir.pipeline import open_split
from lychee_exp.core.ir.trec import write_run
from lychee_exp.core.model import build_encoder, load_tokenizer, model_dir
from lychee_exp.core.outputs import interrupted_line, staged_output
from lychee_exp.launch.scoring import launch_rerank
from lychee_exp.run import command_config, ctrl_c_raises, fail_as_one_line, stop_interrupted

log = logging.getLogger("lychee_exp.rerank")
KEYS = ("ndcg@10", "mrr@10", "map")
RESULTS = ("run.trec", "metrics.json", "logs")  # what a rerank writes into out= (logs: the ranks' of parallel=ddp)


def rerank_command(cfg: RerankConfig) -> dict:
    check_rerank_config(cfg)
    # out= is checked and locked first; the results go to a fresh directory that replaces out= only when complete
    with staged_output(
        cfg.out, directory=True, overwrite=cfg.overwrite, inputs=command_inputs(cfg), results=RESULTS
    ) as staging:
        metrics = _rerank_into(cfg, staging)
    recall = f"recall@{cfg.top_k}"
    shown = ", ".join(f"{k} {metrics[k]:.4f} (first stage {metrics['first_stage_' + k]:.4f})" for k in (*KEYS, recall))
    log.info(
        "%s: %s; %d pairs on %d rank(s), %.1f pairs/s",
        cfg.out,
        shown,
        metrics["pairs"],
        metrics["ranks"],
        metrics["pairs_per_s"],
    )
    return metrics


def _rerank_into(cfg: RerankConfig, out: Path) -> dict:
    # preflight: the data, the first stage (its run cached for the ranks) and the model, before any rank starts
    corpus, split = open_split(cfg.dataset, cfg.split)
    retrieve(cfg.first_stage, corpus, split, cfg.top_k, cfg.dense_model)
    model_dir(cfg.model)
    build_encoder(cfg.model, load_tokenizer(cfg.model))
    plan = plan_devices(cfg.parallel.strategy, cfg.gpus, cpu_threads_per_rank=cfg.parallel.cpu_threads_per_rank)
    result = launch_rerank(cfg, plan, out)
    metrics = {**result["metrics"], "first_stage": cfg.first_stage, "split": cfg.split, "model_path": cfg.model.path}
    write_run(out / "run.trec", result["run"], cfg.tag)
    write_json_atomic(out / "metrics.json", metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    register_ir_schemas()
    cfg = command_config("rerank", argv, RerankConfig)
    try:
        ctrl_c_raises()
        rerank_command(cfg)
    except (UserError, RunFailed) as err:
        fail_as_one_line(err)
    except KeyboardInterrupt:
        stop_interrupted(interrupted_line(cfg.out))


if __name__ == "__main__":
    main()
