"""The steps a command chains: open a dataset's split, mine it to a JSONL file (cached for training's mining
step, ir.training), and the bi-encoder teacher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from lychee_exp.config.choices import Stemmer
from lychee_exp.config.commands import MineConfig, MineSettings, mine_settings
from lychee_exp.config.schema import SCALE, DenseConfig
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.ir.beir import Corpus, Split, dataset_dir, load_corpus, load_split
from lychee_exp.ir.cache import cache_path
from lychee_exp.ir.dense import corpus_embeddings, embed
from lychee_exp.ir.first_stage import retrieve, stage_key
from lychee_exp.ir.mining import MineSummary, Teacher, mine


def open_split(
    dataset: str, split: str, dataset_key: str = "dataset", split_key: str = "split", need_qrels: bool = True
) -> tuple[Corpus, Split]:
    directory = dataset_dir(dataset, dataset_key)
    corpus = load_corpus(directory)
    return corpus, load_split(directory, split, corpus, split_key, need_qrels)


def dense_teacher(corpus: Corpus, split: Split, dense: DenseConfig, key: str = "dense.model") -> Teacher:
    """Scaled cosine of the bi-encoder's embeddings (corpus embeddings cached; the split's queries once)."""
    docs = corpus_embeddings(corpus, dense, key)
    query_row = {qid: i for i, qid in enumerate(split.query_ids)}
    queries = embed([split.queries[q] for q in split.query_ids], dense, dense.query_prompt, key, "queries")

    def score(pairs: list[tuple[str, str]]) -> list[float]:
        return [SCALE * float(queries[query_row[q]] @ docs[corpus.row[d]]) for q, d in pairs]

    return score


def reranker_teacher(corpus: Corpus, split: Split, model_cfg, batch_size: int, seed: int) -> Teacher:
    """A trained reranker's relevance logits (its own prompt and default instruction), batched by length."""
    import torch

    from lychee_exp.ir.evaluate import score_token_ids
    from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer

    encoder = build_encoder(model_cfg, load_tokenizer(model_cfg))
    model = load_reranker(model_cfg, encoder, seed)
    instruction = model_cfg.prompt.default_instruction

    def score(pairs: list[tuple[str, str]]) -> list[float]:
        prompts = [(instruction, split.queries[q], corpus.text(d)) for q, d in pairs]
        return score_token_ids(model, encoder, encoder.encode_many(prompts), batch_size, torch.device("cpu"))

    return score


def mine_to_file(
    corpus: Corpus,
    split: Split,
    first_stage: str,
    settings: MineSettings,
    out: Path,
    teacher: str = "none",
    dense: DenseConfig | None = None,
    progress: Callable[[Iterable], Iterable] = lambda items: items,
    teacher_model=None,
    batch_size: int = 64,
    stemmer: Stemmer = Stemmer.porter,
    key_prefix: str = "",
) -> MineSummary:
    """key_prefix: where the command's keys live ("data." for data=beir), to name them in errors."""
    dense = dense or DenseConfig()
    run = retrieve(first_stage, corpus, split, settings.range_max, dense, f"{key_prefix}first_stage", stemmer=stemmer)
    scorer = None
    if teacher == "dense":
        scorer = dense_teacher(corpus, split, dense, f"{key_prefix}dense.model")
    elif teacher == "reranker":
        scorer = reranker_teacher(corpus, split, teacher_model, batch_size, settings.seed)
    lines, summary = mine(corpus, split, run, settings, scorer, progress)
    if not summary.written:  # an empty file would pass for a mined split
        why = f"split {split.name!r}: no query has a negative to write ({summary.line()})"
        raise UserError(f"{why}: widen range_min/range_max, or loosen the margins and max_score")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return summary


def mined_train_path(
    corpus: Corpus,
    split: Split,
    first_stage: str,
    dense: DenseConfig,
    stemmer: Stemmer = Stemmer.porter,
    create: bool = True,
) -> Path:
    """Where training keeps a split mined without data.train_file: the cache entry of mine's defaults (the
    bi-encoder as teacher) on this split and first stage (create=False: a lookup that only reads)."""
    first = stage_key(first_stage, dense, stemmer, "data.first_stage")
    teacher = stage_key("dense", dense, key="data.first_stage")  # the bi-encoder teacher's settings and files
    parts = (corpus.key, split.key, first, teacher, vars(_training_settings()))
    return cache_path("mined", *parts, create=create).with_suffix(".jsonl")


def mine_train_file(
    corpus: Corpus,
    split: Split,
    first_stage: str,
    dense: DenseConfig,
    stemmer: Stemmer,
    out: Path,
    progress: Callable[[Iterable], Iterable] = lambda items: items,
) -> MineSummary:
    """Training's mining step (ir.training.mine_train_split): the split mined with mine's defaults into `out`."""
    settings = _training_settings()
    return mine_to_file(
        corpus, split, first_stage, settings, out, "dense", dense, progress, stemmer=stemmer, key_prefix="data."
    )


def _training_settings() -> MineSettings:
    return mine_settings(MineConfig(teacher="dense"))
