"""Entry point: `python -m lychee_exp.rerank dataset=<beir dir> split=test first_stage=bm25 top_k=100
model=minilm_cross_encoder model.path=<run dir>/model out=<dir> [parallel=ddp gpus=N]`.

Scores a split's first-stage top-k with a trained run's model/ (or any model preset's weights) and writes
<out>/run.trec (TREC run) and <out>/metrics.json: ndcg@10, mrr@10, recall@<top_k>, map as trec_eval computes
them on run.trec and the split's qrels, the same keys prefixed first_stage_, and pairs/s. Everything a user can
get wrong is checked before any rank starts; a mistake is one line, exit 2.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lychee_exp.core.atomic import write_json_atomic
from lychee_exp.core.devices import plan_devices
from lychee_exp.core.errors import RunFailed, UserError
from lychee_exp.core.ir.config import RerankConfig, check_rerank_config, register_ir_schemas
from lychee_exp.core.ir.first_stage import retrieve
from lychee_exp.core.ir.pipeline import open_split
from lychee_exp.core.ir.trec import write_run
from lychee_exp.core.model import build_encoder, load_tokenizer, model_dir
from lychee_exp.core.model_card import check_trained_head
from lychee_exp.launch.scoring import launch_rerank
from lychee_exp.run import command_config, fail_as_one_line

log = logging.getLogger("lychee_exp.rerank")
KEYS = ("ndcg@10", "mrr@10", "map")


def rerank_command(cfg: RerankConfig) -> dict:
    check_rerank_config(cfg)
    out = Path(cfg.out)
    # preflight: the data, the first stage (its run cached for the ranks) and the model, before any rank starts
    corpus, split = open_split(cfg.dataset, cfg.split)
    retrieve(cfg.first_stage, corpus, split, cfg.top_k, cfg.dense_model)
    model_dir(cfg.model)
    check_trained_head(cfg.model)  # never a freshly initialised head
    build_encoder(cfg.model, load_tokenizer(cfg.model))
    plan = plan_devices(cfg.parallel.strategy, cfg.gpus, cpu_threads_per_rank=cfg.parallel.cpu_threads_per_rank)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("run.trec", "metrics.json"):  # a stale result must not pass for this run's
        (out / stale).unlink(missing_ok=True)
    result = launch_rerank(cfg, plan, out)
    metrics = {**result["metrics"], "first_stage": cfg.first_stage, "split": cfg.split, "model_path": cfg.model.path}
    write_run(out / "run.trec", result["run"], cfg.tag)
    write_json_atomic(out / "metrics.json", metrics)
    recall = f"recall@{cfg.top_k}"
    shown = ", ".join(f"{k} {metrics[k]:.4f} (first stage {metrics['first_stage_' + k]:.4f})" for k in (*KEYS, recall))
    log.info(
        "%s: %s; %d pairs on %d rank(s), %.1f pairs/s",
        out,
        shown,
        metrics["pairs"],
        metrics["ranks"],
        metrics["pairs_per_s"],
    )
    return metrics


def main(argv: list[str] | None = None) -> None:
    register_ir_schemas()
    cfg = command_config("rerank", argv, RerankConfig)
    try:
        rerank_command(cfg)
    except (UserError, RunFailed) as err:
        fail_as_one_line(err)


if __name__ == "__main__":
    main()
