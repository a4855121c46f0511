"""Reranker scoring equals an independent p(yes) computation; loading errors; LoRA; save and reload."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from lychee_exp.config.schema import to_run_config
from lychee_exp.errors import UserError
from lychee_exp.model.files import CARD_FILE
from lychee_exp.model.reranker import (
    Reranker,
    build_encoder,
    count_parameters,
    load_reranker,
    load_tokenizer,
    save_reranker,
)

DOCS = [
    "lychee",
    "Lychee is a tropical tree native to southern China, grown for its sweet fruit.",
    " ".join(["The fruit has a rough pink-red skin and white flesh with a floral smell."] * 6),
]


def model_cfg(tmp_path, *overrides):
    return to_run_config(compose_config(["model=tiny_lychee", *overrides], tmp_path / "run")).model


def tiny_reranker(tmp_path, *overrides, seed=0):
    cfg = model_cfg(tmp_path, *overrides)
    tokenizer = load_tokenizer(cfg)
    encoder = build_encoder(cfg, tokenizer)
    return cfg, tokenizer, encoder, load_reranker(cfg, encoder, seed)


def _spread_weights(module: torch.nn.Module, seed: int = 1) -> None:
    """Random init gives p(yes) ~ 0.5 everywhere; larger weights make the scores differ, so parity has teeth."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A tiny random Qwen2 saved as a plain transformers directory (weights + tokenizer)."""
    tmp = tmp_path_factory.mktemp("tiny_saved")
    cfg, tokenizer, encoder, reranker = tiny_reranker(tmp)
    _spread_weights(reranker.backbone)
    out = tmp / "model"
    reranker.backbone.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _prompts(encoder):
    ids = [encoder.encode("Retrieve facts about fruit", "what is a lychee", doc) for doc in DOCS]
    lengths = sorted(len(i) for i in ids)
    assert lengths[-1] - lengths[0] >= 40, lengths  # clearly different lengths: real left padding
    return ids


def test_probability_matches_independent_per_example_computation(saved_tiny, tmp_path):
    cfg, tokenizer, encoder, reranker = tiny_reranker(tmp_path, f"model.path={saved_tiny}", "model.random_init=false")
    reranker.eval()
    ids = _prompts(encoder)
    batch = encoder.pad(ids)
    assert batch["attention_mask"][:, 0].tolist().count(0) >= 2  # left padded
    got = reranker.probability(batch["input_ids"], batch["attention_mask"])

    raw = AutoModelForCausalLM.from_pretrained(str(saved_tiny), dtype=torch.float32).eval()
    raw_tok = AutoTokenizer.from_pretrained(str(saved_tiny))
    yes = raw_tok("yes", add_special_tokens=False)["input_ids"]
    no = raw_tok("no", add_special_tokens=False)["input_ids"]
    assert len(yes) == len(no) == 1
    expected = []
    with torch.no_grad():
        for seq in ids:
            logits = raw(input_ids=torch.tensor([seq])).logits[0, -1]
            expected.append(torch.softmax(logits[[yes[0], no[0]]], dim=0)[0].item())
    expected = torch.tensor(expected)
    assert expected.std() > 0.01, expected  # the examples really score differently
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=0)


def test_logit_is_yes_minus_no(saved_tiny, tmp_path):
    cfg, tokenizer, encoder, reranker = tiny_reranker(tmp_path, f"model.path={saved_tiny}", "model.random_init=false")
    batch = encoder.pad(_prompts(encoder))
    with torch.no_grad():
        logits = reranker(batch["input_ids"], batch["attention_mask"])
    prob = reranker.probability(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(torch.sigmoid(logits), prob)


def test_scores_do_not_depend_on_batch_company(saved_tiny, tmp_path):
    cfg, tokenizer, encoder, reranker = tiny_reranker(tmp_path, f"model.path={saved_tiny}", "model.random_init=false")
    ids = _prompts(encoder)
    together = reranker.probability(**encoder.pad(ids))
    alone = torch.cat([reranker.probability(**encoder.pad([seq])) for seq in ids])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_random_init_is_seeded(tmp_path):
    _, _, enc, a = tiny_reranker(tmp_path, seed=3)
    _, _, _, b = tiny_reranker(tmp_path, seed=3)
    _, _, _, c = tiny_reranker(tmp_path, seed=4)
    batch = enc.pad(_prompts(enc))
    assert torch.equal(a(**batch), b(**batch))
    assert not torch.equal(a(**batch), c(**batch))


@pytest.mark.parametrize("path", ["/definitely/not/here", "pkg://no_such_package_xyz/model"])
def test_bad_model_path_is_user_error(path, tmp_path):
    cfg = model_cfg(tmp_path, f"model.path={path}", "model.random_init=false")
    with pytest.raises(UserError, match="model.path"):
        load_tokenizer(cfg)


def test_model_dir_without_config_json_is_user_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = model_cfg(tmp_path, f"model.path={empty}")
    with pytest.raises(UserError, match="config.json"):
        load_tokenizer(cfg)


def test_model_dir_without_weights_is_user_error(tmp_path):
    # The shipped tiny_qwen2 has a config and tokenizer but no weights.
    cfg = model_cfg(tmp_path, "model.random_init=false")
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    with pytest.raises(UserError, match="random_init"):
        load_reranker(cfg, encoder, 0)


@pytest.mark.parametrize("key", ["yes_token", "no_token"])
def test_multi_token_answer_is_user_error(key, tmp_path):
    cfg = model_cfg(tmp_path, f"model.prompt.{key}='definitely relevant indeed'")
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    with pytest.raises(UserError, match=f"model.prompt.{key}"):
        load_reranker(cfg, encoder, 0)


LORA = [
    "model.lora.enabled=true",
    "model.lora.r=4",
    "model.lora.alpha=8",
    "model.lora.target_modules=[q_proj,v_proj]",
    "model.lora.dropout=0.0",
]


def test_lora_trains_only_adapters(tmp_path):
    cfg, tokenizer, encoder, reranker = tiny_reranker(tmp_path, *LORA)
    total, trainable = count_parameters(reranker)
    assert 0 < trainable < total
    names = [n for n, p in reranker.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any("q_proj" in n for n in names) and any("v_proj" in n for n in names)
    assert not any("k_proj" in n or "o_proj" in n for n in names)

    before = {n: p.detach().clone() for n, p in reranker.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in reranker.parameters() if p.requires_grad], lr=1e-2)
    batch = encoder.pad(_prompts(encoder))
    target = torch.tensor([1.0, 0.0, 0.0])
    losses = []
    for _ in range(5):
        logits = reranker(batch["input_ids"], batch["attention_mask"])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    changed = {n for n, p in reranker.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert losses[-1] < losses[0]


def test_unknown_lora_target_is_user_error(tmp_path):
    with pytest.raises(UserError, match="target_modules"):
        tiny_reranker(tmp_path, "model.lora.enabled=true", "model.lora.target_modules=[not_a_layer]")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_merged"])
def test_save_and_reload_scores_identically(lora, tmp_path):
    cfg, tokenizer, encoder, reranker = tiny_reranker(tmp_path, *(LORA if lora else []))
    _spread_weights(reranker.backbone, seed=2)  # also makes LoRA's B non-zero, so merging matters
    if lora:
        assert any("lora_B" in n and p.abs().sum() > 0 for n, p in reranker.named_parameters())
    reranker.eval()
    batch = encoder.pad(_prompts(encoder))
    before = reranker.probability(**batch)

    out = tmp_path / "saved"
    save_reranker(reranker, tokenizer, cfg, out)
    assert json.loads((out / CARD_FILE).read_text())["kind"] == "causal_lm"
    assert not (out / "adapter_config.json").exists()  # a plain model, LoRA merged in

    cfg2, _, encoder2, reloaded = tiny_reranker(tmp_path, f"model.path={out}", "model.random_init=false")
    reloaded.eval()
    assert (
        count_parameters(reloaded)[0] == count_parameters(tiny_reranker(tmp_path)[3])[0]
    )  # same architecture as the plain model
    after = reloaded.probability(**encoder2.pad(_prompts(encoder2)))
    assert before.std() > 0.01
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    # and the directory loads with plain transformers too
    AutoModelForCausalLM.from_pretrained(str(out))


def test_reranker_forward_sequence_classification_uses_single_logit():
    class Head(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": (input_ids.float().sum(1, keepdim=True) * attention_mask[:, :1])})

    reranker = Reranker(Head(), "sequence_classification")
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    torch.testing.assert_close(reranker(ids, mask), torch.tensor([6.0, 9.0]))
