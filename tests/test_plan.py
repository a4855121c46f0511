"""`python -m lychee_exp.plan` and parallel.memory_plan: the model built on the meta device holds the parameters a run
loads; the activation estimate against the tensors a forward really keeps for its backward; the shipped
architectures; the command's lines and one-line errors; the docs table is the planner's. (That the per-rank bytes
equal what runs measure, for single, ddp and fsdp: tests/test_fsdp.py and tests/test_ddp.py.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch.multiprocessing.reductions import StorageWeakRef

from lychee_exp.config.schema import LoraConfig, ModelConfig, to_run_config
from lychee_exp.model.reranker import add_lora, count_parameters, load_reranker
from lychee_exp.parallel.memory_plan import (
    ARCHITECTURES,
    Tensor,
    activation_bytes,
    model_tensors,
    state_per_rank,
)
from lychee_exp.plan import main
from lychee_exp.train.inputs import load_inputs

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "lychee_exp" / "assets" / "tiny_qwen2" / "config.json"


def saved_bytes(model: torch.nn.Module, rows: int, width: int) -> int:
    """Bytes of the tensors one training forward keeps for its backward (each storage once, weights left out)."""
    ids = torch.randint(1, 4000, (rows, width))
    mask = torch.ones_like(ids)
    weights = {StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage()).cdata
        if key not in weights:
            kept[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1, logits_to_keep=1, use_cache=False)
    return sum(kept.values())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_activation_estimate_is_within_a_quarter_of_what_a_forward_keeps(lora):
    """A Qwen2 of 3 layers, 256 wide, fp32 on the CPU, 16 rows x 64 tokens: the estimate against the bytes saved for
    the backward; with checkpointing, against the layers' inputs kept plus one layer recomputed."""
    shape = {**json.loads(TINY.read_text()), "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 3}
    shape["layer_types"] = ["full_attention"] * 3
    cfg = ModelConfig(name="wider", path=str(TINY.parent), lora=LoraConfig(enabled=lora, r=8, alpha=16))
    measured = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**shape))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = add_lora(model, cfg) if lora else model
        measured[checkpointing] = saved_bytes(model.train(), 16, 64)
    full = activation_bytes(shape, cfg, 16 * 64, False, "fp32")
    assert 0.75 < measured[False] / full < 1.25, (measured, full)
    recomputing = measured[True] + measured[False] / 3
    assert 0.75 < recomputing / activation_bytes(shape, cfg, 16 * 64, True, "fp32") < 1.25, measured
    assert measured[True] < measured[False] / 4


@pytest.mark.parametrize("extra", [[], ["model=tiny_lychee", "model.lora.enabled=true"]], ids=["minilm", "lora"])
def test_the_meta_model_holds_the_parameters_a_run_loads(compose_cfg, tmp_path, extra):
    cfg = to_run_config(compose_cfg(extra, tmp_path))
    tensors, _ = model_tensors(cfg.model, "fp32")
    inputs = load_inputs(cfg)
    loaded = load_reranker(cfg.model, inputs.encoder, seed=0, training=True)
    assert count_parameters(loaded) == (
        sum(t.local_bytes(0, 1) // t.element_size for t in tensors),
        sum(t.local_bytes(0, 1) // t.element_size for t in tensors if t.trainable),
    )
    assert sorted(t.shape for t in tensors) == sorted(tuple(p.shape) for p in loaded.parameters())


def test_fsdp_splits_dim_0_as_torch_chunk_does():
    """7 rows on 4 ranks: 2, 2, 2, 1; 1 row on 2 ranks: 1, 0 (the step counter stays whole on every rank)."""
    for rows, ranks in ((7, 4), (1, 2), (8, 8), (5, 3)):
        chunks = [c.shape[0] for c in torch.chunk(torch.zeros(rows, 3), ranks)]
        chunks += [0] * (ranks - len(chunks))
        assert [Tensor((rows, 3), 4, True).rows(r, ranks) for r in range(ranks)] == chunks
    states = state_per_rank([Tensor((1, 2), 4, True), Tensor((3,), 4, False)], "fsdp", 2)
    assert [(s.param_bytes, s.grad_bytes, s.optimizer_bytes) for s in states] == [(16, 8, 20), (4, 0, 4)]


def test_shipped_architectures_have_their_published_sizes():
    """assets/architectures: each file's parameter count is the model card's (build_architectures checks it when
    it writes them); here the 1.5B's LoRA r=64 on the seven projections, and fsdp's 8 shards of the 8B."""
    assert {p.parent.name for p in ARCHITECTURES.glob("*/*/config.json")} >= {
        "lychee-rerank", "Qwen3-Reranker-4B", "Qwen3-Reranker-8B"
    }  # fmt: skip
    lora = ModelConfig(name="lychee", path="vec-ai/lychee-rerank", dtype="bfloat16", lora=LoraConfig(enabled=True))
    tensors, _ = model_tensors(lora, "bf16")
    trainable = sum(t.local_bytes(0, 1) // t.element_size for t in tensors if t.trainable)
    # r x (in + out) per projection: q, k, v, o, gate, up, down on 28 layers of Qwen2.5-1.5B
    assert trainable == 64 * 28 * ((1536 + 1536) + 2 * (1536 + 256) + (1536 + 1536) + 3 * (1536 + 8960))
    full = ModelConfig(name="q8", path="Qwen/Qwen3-Reranker-8B", dtype="bfloat16")
    tensors, _ = model_tensors(full, "bf16")
    states = state_per_rank(tensors, "fsdp", 8)
    assert sum(s.param_bytes for s in states) == 2 * 8_190_735_360
    assert max(s.param_bytes for s in states) - min(s.param_bytes for s in states) < 2 * 4096 * 36 * 4


def test_plan_prints_each_part_and_whether_it_fits(capsys):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        main(
            ["experiment=lychee_lora", "model.path=vec-ai/lychee-rerank", "parallel=fsdp", "gpus=8", "device_gib=24,80"]
        )
    # peft reads transformers' deprecated is_gradient_checkpointing on every LoRA model (model.reranker.add_lora)
    assert not [w for w in said if issubclass(w.category, FutureWarning)], [str(w.message) for w in said]
    out = capsys.readouterr().out
    assert "parallel=fsdp on 8 device(s)" in out and "16,384 token slots" in out
    for part in ("parameters       exact", "AdamW state      exact", "activations      estimate", "gathered (fsdp)"):
        assert part in out, part
    assert "fits: 24 GiB: with gradient checkpointing; 80 GiB: with gradient checkpointing" in out


def test_a_mistake_is_one_line_from_the_command():
    proc = subprocess.run([sys.executable, "-m", "lychee_exp.plan", "device_gib=big"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: device_gib=big: expected device sizes in GiB, e.g. device_gib=24,80,141\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["model.path=nowhere/model", "gpus=2"],
            "model.path=nowhere/model: no config.json there; shipped architectures: ",
        ),
        (["parallel=fsdp", "gpus=auto"], "gpus=auto: no CUDA device here"),
        (["parallel=fdsp"], "parallel=fdsp: no such option"),
        (["device_gib=0"], "device_gib=0: expected device sizes in GiB"),
    ],
)
def test_a_mistake_is_one_line(args, message, capsys):
    if "gpus=auto" in args and torch.cuda.is_available():
        pytest.skip("CUDA is visible: gpus=auto plans for its devices")
    with pytest.raises(SystemExit) as ended:
        main(args)
    out, err = capsys.readouterr()
    assert ended.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_docs_table_is_the_planners():
    spec = importlib.util.spec_from_file_location("make_memory_table", ROOT / "docs" / "make_memory_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.table() in (ROOT / "docs" / "multi_gpu.md").read_text()
