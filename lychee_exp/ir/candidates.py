"""The pairs a reranker scores for a BEIR split: each query's first-stage top-k, tokenized once, with what
trec_eval-style metrics need (the split's qrels, the first stage's run) and the run the scores make."""

from __future__ import annotations

from dataclasses import dataclass, field

from lychee_exp.data.groups import DevPairs
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.ir.beir import Corpus, Split
from lychee_exp.ir.trec import Run, as_written, ranked


@dataclass
class RerankPairs(DevPairs):
    qids: list[str] = field(default_factory=list)  # per pair
    doc_ids: list[str] = field(default_factory=list)
    qrels: dict = field(default_factory=dict)
    first_stage: Run = field(default_factory=dict)
    stage: str = "bm25"  # names the first stage's metrics: bm25_ndcg@10, ...
    recall_at: int = 100

    @property
    def protocol(self) -> str:
        return f"rerank the {self.stage} top-{self.recall_at} of {len(self.first_stage)} queries, trec_eval metrics"

    def run_of(self, scores: list[float]) -> Run:
        """The reranked run (scores as a run file holds them)."""
        run: Run = {qid: {} for qid in self.first_stage}
        for qid, doc, score in zip(self.qids, self.doc_ids, scores):
            run[qid][doc] = score
        return as_written(run)


def build_rerank_pairs(
    corpus: Corpus, split: Split, run: Run, encoder: PromptEncoder, instruction: str, stage: str, top_k: int
) -> RerankPairs:
    pairs = RerankPairs([], [], [], [], qrels=split.qrels, first_stage=run, stage=stage, recall_at=top_k)
    pairs.first_stage_scores = []
    prompts = []
    for qi, qid in enumerate(split.query_ids):
        query = split.queries[qid]
        for doc, first_stage_score in ranked(run.get(qid, {})):
            text = corpus.text(doc)
            pairs.first_stage_scores.append(first_stage_score)
            pairs.qids.append(qid)
            pairs.doc_ids.append(doc)
            pairs.query_index.append(qi)
            pairs.labels.append(max(split.qrels.get(qid, {}).get(doc, 0), 0))
            pairs.texts.append((query, text))
            prompts.append((instruction, query, text))
    pairs.token_ids = encoder.encode_many(prompts)
    return pairs
