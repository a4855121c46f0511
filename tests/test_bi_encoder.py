"""model.kind=bi_encoder (model/bi_encoder.py): pair rows split into each text's own encoding, each cut to
model.prompt.max_len on its own, an untrained student scores exactly as its bi-encoder teacher (ir/dense.py),
gradients equal those of encoding the texts apart, a saved student loads in sentence-transformers with the same
scores, and scoring (dev evaluation, rerank) encodes each distinct text once with sentence-transformers' scores."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from test_packed_encoder import PACKED_KEYS, assert_gradients_match
from test_packing import _grads, _groups

from lychee_exp.config.schema import SCALE, DenseConfig, ModelConfig
from lychee_exp.data.groups import GroupCollator
from lychee_exp.errors import UserError
from lychee_exp.ir.dense import embed
from lychee_exp.ir.evaluate import score_token_ids
from lychee_exp.model.bi_encoder import pool, split_pair
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer, save_reranker
from lychee_exp.train.losses import RankingLoss

PAIRS = [
    ("what is a heap queue", "This module provides an implementation of the heap queue algorithm. " * 3),
    ("json", "json exposes an API familiar to users of marshal and pickle."),
    ("how do I read a zip archive in the standard library", "ZIP archives."),
    ("q", "d"),
    # longer than max_len (256) on its own: cut the same whatever the query, as sentence-transformers cuts it
    ("a rather long question about reading compressed archives " * 4, "ZIP archives hold files. " * 80),
]
WEIGHTS = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])


def bi_encoder_config() -> ModelConfig:
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load("conf/model/minilm_bi_encoder.yaml"))
    return OmegaConf.to_object(node)


@pytest.fixture(scope="module")
def student():
    cfg = bi_encoder_config()
    tokenizer = load_tokenizer(cfg)
    encoder = build_encoder(cfg, tokenizer)
    return cfg, tokenizer, encoder, load_reranker(cfg, encoder, seed=0, training=True)


def batch_of(encoder, pairs):
    return encoder.pad(encoder.encode_many([("", q, d) for q, d in pairs]))


def own(tokenizer, texts, **options):
    """Each text as sentence-transformers encodes it: alone, cut to the model's max_seq_length (256)."""
    return tokenizer(texts, truncation=True, max_length=256, **options)


def test_split_rows_are_each_texts_own_encoding(student):
    _, tokenizer, encoder, _ = student
    assert len(tokenizer(PAIRS[-1][1])["input_ids"]) > 256  # the long document is cut
    batch = batch_of(encoder, PAIRS)
    (q_ids, q_mask), (d_ids, d_mask) = split_pair(batch["input_ids"], batch["attention_mask"], tokenizer.sep_token_id)
    for row, (query, doc) in enumerate(PAIRS):
        assert q_ids[row][q_mask[row].bool()].tolist() == own(tokenizer, query)["input_ids"]
        assert d_ids[row][d_mask[row].bool()].tolist() == own(tokenizer, doc)["input_ids"]
        assert not q_mask[row, int(q_mask[row].sum()) :].any() and not d_mask[row, int(d_mask[row].sum()) :].any()


def test_untrained_student_scores_as_its_teacher(student):
    _, _, encoder, reranker = student
    batch = batch_of(encoder, PAIRS)
    with torch.no_grad():
        ours = reranker.eval()(batch["input_ids"], batch["attention_mask"])
    dense = DenseConfig()
    queries, docs = embed([q for q, _ in PAIRS], dense), embed([d for _, d in PAIRS], dense)
    teacher = SCALE * (torch.from_numpy(queries) * torch.from_numpy(docs)).sum(-1)
    torch.testing.assert_close(ours, teacher, atol=1e-5, rtol=0)


def test_gradients_equal_encoding_the_texts_apart(student):
    cfg, tokenizer, encoder, _ = student
    reranker = load_reranker(cfg, encoder, seed=0, training=True).train()
    batch = batch_of(encoder, PAIRS)
    (reranker(batch["input_ids"], batch["attention_mask"]) * WEIGHTS).sum().backward()
    ours = {name: p.grad.clone() for name, p in reranker.backbone.named_parameters() if p.requires_grad}

    reference = load_reranker(cfg, encoder, seed=0, training=True).train().backbone
    vectors = []
    for texts in ([q for q, _ in PAIRS], [d for _, d in PAIRS]):
        inputs = own(tokenizer, texts, padding=True, return_tensors="pt")
        hidden = reference(**inputs).last_hidden_state
        vectors.append(torch.nn.functional.normalize(pool(hidden, inputs["attention_mask"], cfg.pooling), dim=-1))
    (SCALE * (vectors[0] * vectors[1]).sum(-1) * WEIGHTS).sum().backward()
    assert_gradients_match(ours, {name: p.grad for name, p in reference.named_parameters() if name in ours})
    assert not any(name.startswith("pooler.") for name in ours)  # frozen: DDP expects no gradient for it


def test_saved_student_scores_the_same_in_sentence_transformers(student, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    cfg, tokenizer, encoder, _ = student
    reranker = load_reranker(cfg, encoder, seed=0, training=True).eval()
    with torch.no_grad():  # a trained model is not the teacher: move the weights away from it
        for p in reranker.backbone.encoder.layer[0].parameters():
            p.add_(0.02 * torch.randn_like(p))
        batch = batch_of(encoder, PAIRS)
        ours = reranker(batch["input_ids"], batch["attention_mask"])
    save_reranker(reranker, tokenizer, cfg, tmp_path)
    model = st.SentenceTransformer(str(tmp_path), device="cpu")
    assert model.max_seq_length == cfg.prompt.max_len == 256
    queries = model.encode([q for q, _ in PAIRS], convert_to_tensor=True)
    docs = model.encode([d for _, d in PAIRS], convert_to_tensor=True)
    torch.testing.assert_close(SCALE * model.similarity_pairwise(queries, docs), ours, atol=1e-4, rtol=0)

    reloaded_cfg = bi_encoder_config()
    reloaded_cfg.path = str(tmp_path)
    reloaded = load_reranker(reloaded_cfg, build_encoder(reloaded_cfg, load_tokenizer(reloaded_cfg)), seed=1).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch["input_ids"], batch["attention_mask"]), ours, atol=1e-5, rtol=0)


def test_scoring_encodes_each_text_once_with_sentence_transformers_scores(student, tmp_path):
    """Dev evaluation and rerank (ir.evaluate.score_sharded) of every query against every document: each distinct
    text forwarded once, in batches sorted by length, and the scores SentenceTransformer(<run>/model) gives,
    the long document (cut to 256 tokens on its own) included."""
    st = pytest.importorskip("sentence_transformers")
    cfg, tokenizer, encoder, _ = student
    reranker = load_reranker(cfg, encoder, seed=0, training=True).eval()
    with torch.no_grad():  # away from the teacher
        for p in reranker.backbone.encoder.layer[0].parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    save_reranker(reranker, tokenizer, cfg, tmp_path)
    saved = bi_encoder_config()
    saved.path = str(tmp_path)
    saved_encoder = build_encoder(saved, load_tokenizer(saved))
    model = load_reranker(saved, saved_encoder, seed=1)
    queries, docs = [q for q, _ in PAIRS], [d for _, d in PAIRS]
    pairs = [(q, d) for q in queries for d in docs]
    forwarded = []
    model.backbone.register_forward_hook(
        lambda _, args, kwargs, out: forwarded.append(kwargs["attention_mask"]), with_kwargs=True
    )
    token_ids = saved_encoder.encode_many([("", q, d) for q, d in pairs])
    scores = score_token_ids(model, saved_encoder, token_ids, batch_size=3, device=torch.device("cpu"))

    assert sum(len(mask) for mask in forwarded) == len(queries) + len(docs)  # 10 texts for 25 pairs
    lengths = [int(n) for mask in forwarded for n in mask.sum(1)]
    assert lengths == sorted(lengths, reverse=True)  # longest first: little padding
    reference = st.SentenceTransformer(str(tmp_path), device="cpu")
    q_vectors, d_vectors = (reference.encode(texts, convert_to_tensor=True) for texts in (queries, docs))
    expected = SCALE * reference.similarity(q_vectors, d_vectors).flatten()
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-4, rtol=0)
    # the pair rows training reads give the same scores (the same document, cut the same)
    batch = saved_encoder.pad(token_ids)
    with torch.no_grad():
        torch.testing.assert_close(model(batch["input_ids"], batch["attention_mask"]), expected, atol=1e-4, rtol=0)


def test_a_tokenizer_whose_pairs_do_not_split_is_one_line():
    cfg = bi_encoder_config()
    cfg.path = "pkg://lychee_exp.assets/tiny_qwen2"
    with pytest.raises(UserError, match="model.kind=bi_encoder: this tokenizer's text pairs"):
        build_encoder(cfg, load_tokenizer(cfg))


def test_packed_pairs_give_the_padded_logits_and_gradients(student):
    """data.packing (auto on CPU): each pair repacked as its two texts (model.bi_encoder.bi_encoder_packed_logits)."""
    cfg, _, encoder, _ = student
    padded = load_reranker(cfg, encoder, seed=0, training=True)
    with torch.no_grad():  # away from the teacher, so that the scores spread
        for p in padded.backbone.encoder.layer[1].parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    packed = load_reranker(cfg, encoder, seed=0, packing=True, training=True)
    packed.load_state_dict(padded.state_dict())
    plain = GroupCollator(encoder)(_groups(3))
    row = GroupCollator(encoder, pack_multiple=64)(_groups(3))
    loss = RankingLoss("listwise", 4)
    a = padded(plain["input_ids"], plain["attention_mask"])
    b = packed(row["input_ids"], packed={k: row[k] for k in PACKED_KEYS})
    loss(a)[0].sum().backward()
    loss(b)[0].sum().backward()
    assert a.shape == b.shape == (12,) and a.std() > 0.5
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)
    assert_gradients_match(_grads(packed), _grads(padded))
