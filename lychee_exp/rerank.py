"""Entry point: `python -m lychee_exp.rerank dataset=<beir dir> split=test first_stage=bm25 top_k=100
model=minilm_cross_encoder model.path=<run dir>/model out=<dir> [parallel=ddp gpus=N]`.

Scores a split's first-stage top-k with a trained run's model/ (or any model preset's weights) and writes
<out>/run.trec (TREC run); <out>/metrics.json: ndcg@k and recall@k (k = 1, 3, 5, 10, 100 and top_k), map, mrr@10
as trec_eval -c computes them on run.trec and the split's qrels, the same keys prefixed first_stage_, and the
queries asked, scored and judged; <out>/per_query.tsv: those figures per query; <out>/timing.json: pairs/s. A split
without qrels gets run.trec (and timing.json) alone. With teacher_weight or first_stage_weight > 0 (or a model card
that records one) run.trec ranks by the model mixed with its teacher and/or the first stage (ir.fusion),
run.model.trec by the model alone; teacher_* figures whenever the card names the teacher (teacher_figures). Everything
a user can get wrong is checked before any rank starts; a mistake is one line, exit 2. out= is written as
io.outputs says: whole or not at all, never over an input, an earlier result only with overwrite=true; Ctrl-C
leaves it as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lychee_exp.cli import run_output_command
from lychee_exp.config.commands import RerankConfig, check_rerank_config, command_inputs, register_ir_schemas
from lychee_exp.config.rules import check_mix_weights
from lychee_exp.config.schema import DenseConfig
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_json_atomic, write_text_atomic
from lychee_exp.io.outputs import staged_output
from lychee_exp.io.progress import progress_shown
from lychee_exp.ir.beir import dataset_dir, split_names
from lychee_exp.ir.dense import corpus_embeddings
from lychee_exp.ir.first_stage import retrieve
from lychee_exp.ir.metrics import standing_below_first_stage
from lychee_exp.ir.pipeline import open_split
from lychee_exp.ir.trec import write_run
from lychee_exp.model.files import card_ranking, check_trained_head
from lychee_exp.parallel.devices import DevicePlan, plan_devices

log = logging.getLogger("lychee_exp.rerank")
KEYS = ("ndcg@10", "mrr@10", "map")
# what a rerank writes into out= (logs: the ranks' of parallel=ddp)
RESULTS = ("run.trec", "run.model.trec", "metrics.json", "per_query.tsv", "timing.json", "logs")


def rerank_command(cfg: RerankConfig) -> dict:
    check_rerank_config(cfg)
    # out= is checked and locked first; the results go to a fresh directory that replaces out= only when complete.
    # progress_shown: the preflight's dense encoding's progress too
    inputs = command_inputs(cfg)
    output = staged_output(cfg.out, directory=True, overwrite=cfg.overwrite, inputs=inputs, results=RESULTS)
    with output as staging, progress_shown(cfg.progress_bar):
        metrics, timing = _rerank_into(cfg, staging)
    scored = f"{metrics['queries_scored']} of {metrics['queries']} queries with candidates"
    speed = f"{metrics['pairs']} pairs on {metrics['ranks']} rank(s), {timing['pairs_per_s']:.1f} pairs/s"
    if "ndcg@10" not in metrics:
        log.info("%s: run.trec, no metrics (no qrels); %s; %s", cfg.out, scored, speed)
        return {**metrics, **timing}
    shown = ", ".join(
        f"{k} {metrics[k]:.4f} (first stage {metrics['first_stage_' + k]:.4f})" for k in (*KEYS, f"recall@{cfg.top_k}")
    )
    log.info("%s: %s over %d judged queries (%s); %s", cfg.out, shown, metrics["queries_judged"], scored, speed)
    weights = {"the teacher": cfg.teacher_weight, "the first stage": cfg.first_stage_weight}
    if any(weights.values()):
        mix = " and ".join(f"{who} at weight {w}" for who, w in weights.items() if w)
        log.info("ndcg@10 (run.trec) mixes the model's scores with %s (run.model.trec: the model alone)", mix)
    log.info("%s", standing_line(metrics, cfg.first_stage))
    below = standing_below_first_stage(metrics, "first_stage", cfg.split)
    if below:
        log.warning("%s", below)
    return {**metrics, **timing}


def standing_line(metrics: dict, first_stage: str) -> str:
    """`ndcg@10: model alone X vs first stage (bm25) Y vs teacher Z`: what an IR engineer checks first."""
    alone = metrics.get("model_ndcg@10", metrics["ndcg@10"])
    line = f"ndcg@10: model alone {alone:.4f} vs first stage ({first_stage}) {metrics['first_stage_ndcg@10']:.4f}"
    if "teacher_ndcg@10" in metrics:
        line += f" vs teacher {metrics['teacher_ndcg@10']:.4f}"
    if "model_ndcg@10" in metrics:
        line += f" (mix {metrics['ndcg@10']:.4f})"
    return line


def launch_rerank(cfg: RerankConfig, plan: DevicePlan, out: Path) -> dict:
    """The ranks that score (lychee_exp.launch.scoring), imported once the checks passed: a misspelt key or a
    wrong path is answered without loading torch and the recipe."""
    from lychee_exp.launch.scoring import launch_rerank as launch

    return launch(cfg, plan, out)


def _rerank_into(cfg: RerankConfig, out: Path) -> tuple[dict, dict]:
    from lychee_exp.model.reranker import build_encoder, load_tokenizer, model_dir  # torch: once the config composed

    # preflight: the data, the first stage (its run cached for the ranks) and the model, before any rank starts
    corpus, split = open_split(cfg.dataset, cfg.split, need_qrels=False)
    if not split.qrels:
        log.warning(
            "split=%s: no qrels/%s.tsv in %s (splits with qrels: %s): reranking all %d queries of queries.jsonl, "
            "run.trec only, no metrics",
            cfg.split,
            cfg.split,
            cfg.dataset,
            ", ".join(split_names(dataset_dir(cfg.dataset))) or "none",
            len(split.query_ids),
        )
    retrieve(cfg.first_stage, corpus, split, cfg.top_k, cfg.dense, stemmer=cfg.bm25_stemmer)
    ranking = card_ranking(cfg.model.path)  # the recipe the model was trained with ({"teacher_weight": 0} if none)
    if cfg.teacher_weight is None:  # the card's mix, else the model alone
        cfg.teacher_weight = ranking["teacher_weight"]
    if cfg.first_stage_weight is None:
        cfg.first_stage_weight = ranking.get("first_stage_weight", 0.0)
    check_mix_weights(cfg.teacher_weight, cfg.first_stage_weight)
    if cfg.dense == DenseConfig() and ranking.get("teacher"):  # the teacher the model was trained against
        cfg.dense = DenseConfig(**ranking["teacher"])
    if cfg.teacher_weight and cfg.teacher_figures is False:
        raise UserError(
            f"teacher_figures=false with teacher_weight={cfg.teacher_weight}: the mix needs the teacher's scores"
        )
    if cfg.teacher_figures is None:
        cfg.teacher_figures = bool(cfg.teacher_weight or ranking.get("teacher"))
    if cfg.teacher_figures:
        corpus_embeddings(corpus, cfg.dense, "dense.model")  # cached for rank 0's teacher scores
    model_dir(cfg.model)
    check_trained_head(cfg.model)  # never a freshly initialised head
    build_encoder(cfg.model, load_tokenizer(cfg.model))
    plan = plan_devices(cfg.parallel.strategy, cfg.gpus, cpu_threads_per_rank=cfg.parallel.cpu_threads_per_rank)
    result = launch_rerank(cfg, plan, out)
    counts, timing = result["counts"], result["timing"]
    write_run(out / "run.trec", result["run"], cfg.tag)
    if result["model_run"] is not None:  # teacher_weight > 0: the model's own scores too
        write_run(out / "run.model.trec", result["model_run"], cfg.tag)
    # timing apart: metrics.json is the same file whenever the same command runs again
    write_json_atomic(out / "timing.json", timing)
    metrics = {**result["metrics"], **counts, "first_stage": cfg.first_stage, "split": cfg.split}
    metrics.update(
        model_path=cfg.model.path, teacher_weight=cfg.teacher_weight, first_stage_weight=cfg.first_stage_weight
    )
    if result["metrics"]:
        write_text_atomic(out / "per_query.tsv", result["per_query"])
        write_json_atomic(out / "metrics.json", metrics)
    return metrics, timing


def main(argv: list[str] | None = None) -> None:
    register_ir_schemas()
    run_output_command("rerank", argv, RerankConfig, rerank_command)


if __name__ == "__main__":
    main()
