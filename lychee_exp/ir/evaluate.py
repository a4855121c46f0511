"""Dev evaluation: rerank each query's candidates, NDCG@10 and MRR@10 (BEIR / MS MARCO conventions).

Two protocols. Fixed candidates (a JSONL dev file): each line's pos + neg are reranked, so every positive is
among them (sentence-transformers' always_rerank_positives=True). A BEIR split (data=beir): the first stage's
top-k are reranked and scored as trec_eval does against every judged document (ir.metrics), the way
papers report rerankers.

NDCG uses graded gains (a dev line's `pos_labels`, else 1 per positive) with linear gain as trec_eval does;
MRR counts any gain > 0 as relevant.

Both protocols' metrics come from one implementation, ir.metrics (trec_eval's own code through
pytrec_eval), per query, averaged over queries: a run's dev ndcg@10 and `rerank`'s are computed alike. Scoring is
sharded across ranks and gathered, so every rank ends with the metrics a single process computes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import torch

from lychee_exp.config.choices import MODEL_PREFIX
from lychee_exp.data.groups import DevPairs
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.io.progress import progress_meter
from lychee_exp.ir.candidates import RerankPairs
from lychee_exp.ir.fusion import fuse
from lychee_exp.ir.metrics import mean_metrics, per_query_metrics, trec_metrics
from lychee_exp.model.bi_encoder import distinct_texts, pair_scores
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.parallel.sharding import is_sharded

TOP_K = 10
# token slots per backbone forward when scoring (Reranker.forward's max_tokens): a batch of data.eval_batch_size
# long pairs is forwarded a part at a time, with the same logits. The 384 longest dev pairs of the built-in BEIR set
# in batches of 128 (288 tokens) took a MiniLM bi-encoder process from 0.49 to 1.32 GB (bf16 on CPU) in one forward
# per batch, to 1.01 GB in parts of 32 rows, and in less time (17.6 s against 26.2 s)
SCORING_TOKENS = 8192
log = logging.getLogger(__name__)


def ranking_metrics(
    scores: Sequence[float], labels: Sequence[int], query_index: Sequence[int], prefix: str = ""
) -> dict[str, float]:
    """NDCG@10 (graded, linear gain) and MRR@10 of each query's candidates, averaged over queries; a query with
    no relevant candidate scores 0. Ties keep the (seeded, shuffled) candidate order: the later candidate of a
    tie ranks first, as the dev metrics have always counted them (trec_eval would order ties by document id)."""
    by_query: dict[str, list[int]] = {}
    for row, qi in enumerate(query_index):
        by_query.setdefault(str(qi), []).append(row)
    # documents named by their row, scored by their place in a stable sort of the scores: no two tie, and
    # trec_eval's order is the order described above
    run = {
        qid: {str(row): float(place) for place, row in enumerate(sorted(rows, key=lambda r: float(scores[r])), 1)}
        for qid, rows in by_query.items()
    }
    qrels = {qid: {str(row): int(labels[row]) for row in rows} for qid, rows in by_query.items()}
    rows = per_query_metrics(run, qrels, recall_at=TOP_K)
    wanted = (f"ndcg@{TOP_K}", f"mrr@{TOP_K}")
    return mean_metrics({qid: {name: row[name] for name in wanted} for qid, row in rows.items()}, prefix)


def bm25_scores(pairs: DevPairs) -> list[float]:
    """BM25 (bm25s, Lucene variant) over the dev documents, scoring each query's own candidates."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    documents = sorted({doc for _, doc in pairs.texts})
    doc_row = {doc: i for i, doc in enumerate(documents)}
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(documents, stopwords="en", show_progress=False), show_progress=False)
    cache: dict[str, object] = {}
    scores = []
    for query, doc in pairs.texts:
        if query not in cache:
            tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
            cache[query] = retriever.get_scores(tokens)
        scores.append(float(cache[query][doc_row[doc]]))
    return scores


def reference_metrics(pairs: DevPairs) -> dict[str, float]:
    """The bars a reranker is measured against, logged: BM25 on the dev candidates (bm25_*), and the dev file's
    own teacher scores when it has them (teacher_*). For a BEIR split: the first stage's own metrics on the
    candidates reranked (<stage>_*, e.g. bm25_ndcg@10). Computed once per DevPairs (warm trials reuse them)."""
    refs = pairs.references
    if isinstance(pairs, RerankPairs):
        if not refs:
            refs.update(trec_metrics(pairs.first_stage, pairs.qrels, pairs.recall_at, prefix=f"{pairs.stage}_"))
            if pairs.teacher_scores is not None:
                refs.update(metrics_of(pairs, pairs.teacher_scores, prefix="teacher_"))
        log.info("dev protocol: %s; first stage: %s", pairs.protocol, _brief(refs))
        return dict(refs)
    log.info("dev protocol: fixed candidates (each dev line's pos + neg, positives always among them)")
    if not refs:
        refs.update(ranking_metrics(bm25_scores(pairs), pairs.labels, pairs.query_index, prefix="bm25_"))
        if pairs.teacher_scores is not None:
            refs.update(ranking_metrics(pairs.teacher_scores, pairs.labels, pairs.query_index, prefix="teacher_"))
    log.info("BM25 on the dev candidates: ndcg@10 %.4f, mrr@10 %.4f", refs["bm25_ndcg@10"], refs["bm25_mrr@10"])
    if "teacher_ndcg@10" in refs:
        log.info("teacher scores of the dev file: ndcg@10 %.4f", refs["teacher_ndcg@10"])
    return dict(refs)


@torch.inference_mode()
def score_token_ids(
    model: torch.nn.Module,
    encoder: PromptEncoder,
    token_ids: Sequence[list[int]],
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> list[float]:
    """Relevance logits for tokenized prompts on this process alone, batched by length."""
    return score_sharded(model, encoder, token_ids, batch_size, device, DistEnv(device=device), autocast)


def length_batches(token_ids: Sequence[list[int]], batch_size: int) -> list[list[int]]:
    """Rows in batches of similar length (longest first: the peak memory shows at once), little compute on padding.
    The batches depend only on the prompts, not on how many ranks score them."""
    order = sorted(range(len(token_ids)), key=lambda i: (-len(token_ids[i]), i))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def score_sharded(
    model: torch.nn.Module,
    encoder: PromptEncoder,
    token_ids: Sequence[list[int]],
    batch_size: int,
    device: torch.device,
    env: DistEnv,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    progress: str | None = None,
) -> list[float]:
    """Every rank scores every world_size-th batch of length_batches; the scores are all-gathered. Each batch is
    the same tensor on any number of ranks, so 1 and N ranks give the same scores. A bi-encoder
    (model.kind=bi_encoder) forwards each distinct query and document of the pairs once instead, batched by length
    the same way, and scores each pair by the cosine x 20 of its two vectors (model.bi_encoder.distinct_texts):
    the scores `SentenceTransformer(<run>/model)` gives. A sharded model (parallel=fsdp) gathers its weights from
    every rank in each forward, so a rank short of a batch forwards its last one again, unrecorded: all ranks run
    the same number of forwards. `progress`: the main rank shows the scoring's progress under that name
    (io.progress: a bar, or log lines), counting its own pairs (a bi-encoder's: texts) times the ranks (every rank
    scores about as many)."""
    texts = getattr(getattr(model, "module", model), "kind", None) == "bi_encoder"  # DDP, DataParallel: .module
    rows_in = token_ids
    if texts:
        rows_in, pairs = distinct_texts(token_ids, encoder.sep_id)
    every = length_batches(rows_in, batch_size)
    batches = every[env.rank :: env.world_size]
    sharded = is_sharded(model)
    rounds = -(-len(every) // env.world_size) if sharded else len(batches)
    was_training = model.training
    model.eval()
    mine: list[tuple[int, object]] = []
    shown = progress is not None and env.is_main
    unit = "text" if texts else "pair"
    bar = progress_meter(desc=progress or "", unit=unit, total=len(rows_in), shown=shown, leave=None)
    # FSDP2 writes its gathered weights in place, which inference tensors forbid: no_grad there
    with torch.no_grad() if sharded else torch.inference_mode(), bar:
        for turn in range(rounds):
            rows = batches[min(turn, len(batches) - 1)] if batches else every[0]
            batch = encoder.pad([rows_in[i] for i in rows])
            # a sharded model gathers its weights in each forward: every rank must make the same number of them
            parts = ({} if sharded else {"max_tokens": SCORING_TOKENS}) | ({"texts": True} if texts else {})
            with autocast():
                out = model(batch["input_ids"].to(device), batch["attention_mask"].to(device), **parts)
            if turn < len(batches):
                out = out.float().cpu()
                mine.extend(zip(rows, list(out.numpy()) if texts else out.tolist()))  # a text's vector, a pair's logit
                bar.update(len(rows) * env.world_size)
    model.train(was_training)
    values: list = [0.0] * len(rows_in)
    for part in env.gather_objects(mine):
        for row, value in part:
            values[row] = value
    return pair_scores(values, pairs) if texts else values


def evaluate(
    model: torch.nn.Module,
    encoder: PromptEncoder,
    pairs: DevPairs,
    batch_size: int,
    device: torch.device,
    env: DistEnv | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    teacher_weight: float = 0.0,
    first_stage_weight: float = 0.0,
    progress: str | None = None,
) -> dict[str, float]:
    """Dev metrics of the model's scores, sharded across ranks (score_sharded): the fixed-candidate protocol's
    NDCG@10/MRR@10, or, for a BEIR split's first-stage candidates (RerankPairs), trec_eval's metrics. Each comes
    twice: as model_* the model's own scores, always (what a sweep and the best checkpoint optimize by default), and
    unprefixed the run's ranking: with teacher_weight > 0 (and teacher scores) or first_stage_weight > 0 (and
    first-stage scores) the model's scores mixed with those (ir.fusion), else the model's own again. `progress`:
    the scoring's progress shown under that name (score_sharded)."""
    env = env or DistEnv(device=device)
    scores = score_sharded(model, encoder, pairs.token_ids, batch_size, device, env, autocast, progress)
    partners = [
        (partner, weight)
        for partner, weight in (
            (pairs.teacher_scores, teacher_weight),
            (pairs.first_stage_scores, first_stage_weight),
        )
        if weight > 0 and partner is not None
    ]
    own = metrics_of(pairs, scores)
    ranking = metrics_of(pairs, fuse(scores, pairs.query_index, partners)) if partners else own
    return {**{f"{MODEL_PREFIX}{key}": value for key, value in own.items()}, **ranking}  # the model's first


def metrics_of(pairs: DevPairs, scores: Sequence[float], prefix: str = "") -> dict[str, float]:
    """The dev protocol's metrics of one score per pair: trec_eval's for a BEIR split, else fixed candidates'."""
    if isinstance(pairs, RerankPairs):
        return trec_metrics(pairs.run_of(scores), pairs.qrels, pairs.recall_at, prefix=prefix)
    return ranking_metrics(scores, pairs.labels, pairs.query_index, prefix=prefix)


def _brief(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
