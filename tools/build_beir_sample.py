"""Build the built-in BEIR-format set in ``lychee_exp/assets/beir_sample/`` from the sample set (``sample/``).

Run (from the repo root)::

    python -m tools.build_beir_sample [--out DIR]

Queries are the sample's queries (its qids: module.function names); the corpus is every document of the sample
(each query's positive and its mined negatives, deduplicated), with ids ``d`` + 12 hex digits of the text's
SHA-1; the judgements are the sample's positives (relevance 1). Splits: ``train`` = the sample's train queries;
the sample's dev queries (modules unseen in train) alternate between ``dev`` (even lines) and ``test`` (odd).
Deterministic: the same sample gives the same files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "lychee_exp" / "assets"


def doc_id(text: str) -> str:
    return "d" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def build(sample: Path, out: Path) -> dict[str, int]:
    corpus: dict[str, str] = {}
    queries: dict[str, str] = {}
    qrels: dict[str, list[tuple[str, str]]] = {"train": [], "dev": [], "test": []}
    for source in ("train", "dev"):
        lines = [json.loads(line) for line in (sample / f"{source}.jsonl").read_text(encoding="utf-8").splitlines()]
        for number, line in enumerate(lines):
            split = source if source == "train" else ("dev" if number % 2 == 0 else "test")
            queries[line["qid"]] = line["query"]
            for text in line["pos"] + line["neg"]:
                corpus.setdefault(doc_id(text), text)
            qrels[split] += [(line["qid"], doc_id(text)) for text in line["pos"]]
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as f:
        for key in sorted(corpus):
            f.write(json.dumps({"_id": key, "title": "", "text": corpus[key]}) + "\n")
    with (out / "queries.jsonl").open("w", encoding="utf-8") as f:
        for key in sorted(queries):
            f.write(json.dumps({"_id": key, "text": queries[key]}) + "\n")
    for split, pairs in qrels.items():
        rows = "".join(f"{q}\t{d}\t1\n" for q, d in sorted(pairs))
        (out / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows, encoding="utf-8")
    return {"documents": len(corpus), **{split: len({q for q, _ in pairs}) for split, pairs in qrels.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS / "beir_sample", help="the BEIR directory to write")
    args = parser.parse_args(argv)
    print(build(ASSETS / "sample", args.out))


if __name__ == "__main__":
    main()
