"""A Hugging Face encoder used as a bi-encoder (`DenseConfig`: the model, its pooling and its query/passage
prompts): pooled token embeddings, unit norm, cosine similarity, encoded in batches on the best device (CUDA when
present). Corpus embeddings are cached per corpus and every setting that decides them; a split's top-k is found
by scanning the corpus embeddings in blocks, keeping each query's best k (bounded memory)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from lychee_exp.config.schema import DenseConfig
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_bytes_atomic
from lychee_exp.io.progress import progress_meter
from lychee_exp.io.user_files import resolve_path
from lychee_exp.ir.beir import Corpus
from lychee_exp.ir.cache import cache_path, file_key
from lychee_exp.model.files import check_config_json, check_tokenizer_files, check_weights

BLOCK_ROWS = 32768  # corpus embeddings scored at a time: queries x block_rows floats per step
QUERY_ROWS = 1024  # queries scored at a time against a block


def dense_key(dense: DenseConfig, key: str = "dense.model", queries: bool = True) -> list:
    """What decides dense embeddings (of the queries too, or of passages only): the settings and the encoder's
    files (a model replaced at the same path encodes again)."""
    root = resolve_path(dense.model, key)
    if not (root / "config.json").is_file():
        raise UserError(f"{key}={dense.model}: {root} is not a Hugging Face model directory (no config.json)")
    # before any encoding, or a cache entry named after a damaged directory
    where = f"{key}={dense.model}"
    check_config_json(root, where)
    check_weights(root, where)
    check_tokenizer_files(root, where)
    files = [file_key(p) for p in sorted(root.iterdir()) if p.suffix in (".json", ".safetensors", ".bin")]
    settings = asdict(dense)
    if not queries:
        del settings["query_prompt"]
    return [settings, files]


def best_device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # cuda = this rank's GPU


def embed(
    texts: list[str], dense: DenseConfig, prompt: str = "", key: str = "dense.model", what: str = "texts"
) -> np.ndarray:
    """Unit-norm float32 embeddings of prompt + text, one row per text; batched longest first, so little is
    padding. Its progress is shown as `encode <what>` (io.progress; off within progress_shown(False))."""
    import torch
    import transformers
    from transformers import AutoModel, AutoTokenizer

    # the student's encoding (pooled, unit norm); here, not at import: it loads torch
    from lychee_exp.model.bi_encoder import text_vectors

    transformers.logging.disable_progress_bar()
    path = str(resolve_path(dense.model, key))
    device = best_device()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval().to(device)
    texts = [prompt + text for text in texts]
    order = sorted(range(len(texts)), key=lambda i: (-len(texts[i]), texts[i]))
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    bar = progress_meter(desc=f"encode {what}", unit="text", units=what, total=len(texts))
    with torch.inference_mode(), bar:
        for start in range(0, len(order), dense.batch_size):
            rows = order[start : start + dense.batch_size]
            batch = tokenizer(
                [texts[i] for i in rows], padding=True, truncation=True, max_length=dense.max_len, return_tensors="pt"
            ).to(device)
            out[rows] = text_vectors(model, batch["input_ids"], batch["attention_mask"], dense.pooling).cpu().numpy()
            bar.update(len(rows))
    return out


def corpus_embeddings(corpus: Corpus, dense: DenseConfig, key: str = "dense.model") -> np.ndarray:
    cached = cache_path("dense", corpus.key, dense_key(dense, key, queries=False)).with_suffix(".npy")
    if cached.exists():
        return np.load(cached)
    vectors = embed(corpus.texts, dense, dense.passage_prompt, key, "passages")
    write_bytes_atomic(cached, _npy_bytes(vectors))
    return vectors


def top_k_by_blocks(
    queries: np.ndarray, docs: np.ndarray, k: int, block_rows: int | None = None, query_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each query's k highest inner products with the document rows, as (scores, row indices) [queries, k],
    best first, ties by row index: what a stable sort of the whole queries x docs matrix gives, computed a block
    of documents at a time on the best device, keeping only the running top k."""
    import torch

    device, block_rows, query_rows = best_device(), block_rows or BLOCK_ROWS, query_rows or QUERY_ROWS
    k = min(k, len(docs))
    query_tensor = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(device)
    best = torch.full((len(queries), 0), float("-inf"), device=device)
    best_rows = torch.zeros((len(queries), 0), dtype=torch.long, device=device)
    for start in range(0, len(docs), block_rows):
        block = torch.from_numpy(np.ascontiguousarray(docs[start : start + block_rows], dtype=np.float32)).to(device)
        merged, merged_rows = [], []
        for q in range(0, len(queries), query_rows):
            scores = query_tensor[q : q + query_rows] @ block.T
            rows = torch.arange(start, start + len(block), device=device).expand_as(scores)
            # earlier blocks first: their rows are lower, so a stable sort keeps ties in row order
            scores = torch.cat([best[q : q + query_rows], scores], dim=1)
            rows = torch.cat([best_rows[q : q + query_rows], rows], dim=1)
            top, where = _stable_top(scores, k)
            merged.append(top)
            merged_rows.append(rows.gather(1, where))
        best, best_rows = torch.cat(merged), torch.cat(merged_rows)
    return best.cpu().numpy(), best_rows.cpu().numpy()


def _stable_top(scores, k: int):
    """The k best columns of each row, best first, ties by column: torch.topk where no tie straddles the k-th
    place (its order among ties is unspecified), a stable sort of the rows where one does."""
    import torch

    if k >= scores.shape[1]:
        return torch.sort(scores, dim=1, descending=True, stable=True)
    top, where = torch.topk(scores, k + 1, dim=1)
    # re-sort the k+1 by (score, column): topk's own order among equal scores is arbitrary
    where, order = torch.sort(where, dim=1)
    top = top.gather(1, order)
    top, order = torch.sort(top, dim=1, descending=True, stable=True)
    where = where.gather(1, order)
    straddles = top[:, k - 1] == top[:, k]
    if straddles.any():  # the k-th place is shared: only a full stable sort knows which columns come first
        rows = straddles.nonzero().squeeze(1)
        full, full_where = torch.sort(scores[rows], dim=1, descending=True, stable=True)
        top[rows], where[rows] = full[:, : k + 1], full_where[:, : k + 1]
    return top[:, :k], where[:, :k]


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
