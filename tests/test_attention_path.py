"""Which attention a run's packed rows take, recorded and decided at setup: on CUDA a packed run without a working
varlen kernel stops in one line unless data.packing_fallback=sdpa; the CPU takes sdpa per prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_OVERRIDES, compose_config
from hydra.errors import ConfigCompositionException
from test_packing import _groups, _pair

from lychee_exp.config.schema import to_run_config
from lychee_exp.data.groups import GroupCollator
from lychee_exp.errors import UserError
from lychee_exp.model import packed as packed_rows

CUDA = torch.device("cuda", 0)
KEYS = ("position_ids", "cu_seqlens", "last_index", "max_length", "bounds")


def test_the_paths_a_forward_takes_are_recorded(tmp_path):
    encoder, padded, packed = _pair(tmp_path)
    groups = _groups(2)
    packed_rows.ATTENTION_PATHS.clear()
    row = GroupCollator(encoder, pack_multiple=64)(groups)
    packed(row["input_ids"], packed={k: row[k] for k in KEYS})
    seen = packed_rows.ATTENTION_PATHS
    assert seen == {"sdpa_per_prompt"}
    batch = GroupCollator(encoder)(groups)
    packed(batch["input_ids"], batch["attention_mask"])  # an evaluation batch through the packed model
    seen = packed_rows.ATTENTION_PATHS
    assert seen == {"sdpa_per_prompt", "sdpa_padded"}


@pytest.fixture
def probe(monkeypatch):
    verdict = {"value": (False, "varlen_attn failed: RuntimeError: no kernel image")}
    monkeypatch.setattr(packed_rows, "varlen_probe", lambda device: verdict["value"])
    return verdict


def test_cuda_without_varlen_stops_naming_the_fallback_key(probe):
    with pytest.raises(UserError, match="data.packing_fallback=sdpa") as err:
        packed_rows.check_packed_attention(CUDA, "bf16", "sdpa", 0.0, "none")
    assert "no kernel image" in str(err.value) and "\n" not in str(err.value)
    assert packed_rows.check_packed_attention(CUDA, "bf16", "sdpa", 0.0, "sdpa") == "sdpa_per_prompt"
    with pytest.raises(UserError, match="trainer.precision=fp32"):
        probe["value"] = (True, "ok")
        packed_rows.check_packed_attention(CUDA, "fp32", "sdpa", 0.0, "none")  # the kernel wants half precision
    assert packed_rows.check_packed_attention(CUDA, "bf16", "sdpa", 0.0, "none") == "varlen"
    with pytest.raises(UserError, match="attention dropout"):
        packed_rows.check_packed_attention(CUDA, "bf16", "sdpa", 0.1, "none")
    with pytest.raises(UserError, match="attends both ways"):  # an encoder: the varlen call here is causal
        packed_rows.check_packed_attention(CUDA, "bf16", "sdpa", 0.0, "none", causal=False)
    assert packed_rows.check_packed_attention(CUDA, "bf16", "sdpa", 0.0, "sdpa", causal=False) == "sdpa_per_prompt"


def test_the_cpu_takes_the_per_prompt_path_without_asking(probe, tmp_path):
    cfg = to_run_config(compose_config([*TINY_OVERRIDES, "data.packing=true"], tmp_path))
    assert packed_rows.packed_attention_path_of(cfg, torch.device("cpu"), "fp32") == "sdpa_per_prompt"
    cfg = to_run_config(compose_config([*TINY_OVERRIDES, "model.attn_implementation=eager"], tmp_path))
    assert packed_rows.packed_attention_path_of(cfg, CUDA, "bf16") == "eager_padded"  # not packed: nothing to probe


def test_an_unknown_fallback_fails_at_compose_naming_the_key_and_choices(tmp_path):
    with pytest.raises(ConfigCompositionException) as caught:
        compose_config([*TINY_OVERRIDES, "data.packing_fallback=flash"], tmp_path)
    assert caught.value.__cause__.full_key == "data.packing_fallback" and "[none, sdpa]" in str(caught.value.__cause__)


def test_varlen_probe_says_why_not_without_cuda():
    works, why = packed_rows.varlen_probe(torch.device("cpu"))
    assert works is False and "CUDA" in why
