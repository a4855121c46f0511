"""The GPU check (benchmarks/gpu_check.py): its FLOP accounting and timed window on hand-made inputs, its
time budget, Ctrl-C (one line, exit 130, the earlier report kept) and what it leaves in $TMPDIR (nothing), and
(slow) the whole check end to end on the CPU with the tiny model (--tiny), read back from its JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from conftest import REPO_ROOT, TINY_QWEN2
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import gpu_check
from benchmarks.gpu.flops import QWEN25_1P5B, Shape, step_flops
from benchmarks.gpu.lychee_lora_run import has_key
from benchmarks.gpu.profile import summarise
from benchmarks.gpu.timed_runs import ABLATION, Budget, Runner, ablation_skip
from benchmarks.gpu.timing import BatchLog, WindowClock, forward_rows, window_figures
from benchmarks.gpu.weights import fingerprints

SHAPE = Shape.of(QWEN25_1P5B)


def counted_flops(tmp_path, lengths: list[int], checkpointing: bool) -> tuple[float, Shape, int]:
    """FlopCounterMode's count of one forward + backward of the tiny Qwen2 with LoRA (r=4, no dropout) on
    left-padded rows of `lengths`, the answer head's one row included (the LM head module itself never runs).
    Eager attention: its matmuls are counted as bmm (the CPU's fused sdpa kernel has no FLOP rule). The
    embeddings' output is made to need a gradient so that the first layer's input gradient is computed, as the
    formula counts it (2N backward for every layer)."""
    from test_model import model_cfg

    from lychee_exp.model.reranker import build_encoder, load_reranker, load_tokenizer

    overrides = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.dropout=0.0"]
    overrides += ["model.attn_implementation=eager", f"model.gradient_checkpointing={str(checkpointing).lower()}"]
    cfg = model_cfg(tmp_path, *overrides)
    encoder = build_encoder(cfg, load_tokenizer(cfg))
    model = load_reranker(cfg, encoder, 0).train()
    model.backbone.get_input_embeddings().register_forward_hook(lambda m, i, out: out.detach().requires_grad_())
    width = max(lengths)
    ids = torch.randint(5, 4000, (len(lengths), width))
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    with FlopCounterMode(display=False) as counter:
        model(ids, mask).sum().backward()
    counts = counter.get_flop_counts()
    assert not [name for name in counts if name.endswith("lm_head")]  # no full-vocabulary projection
    shape = Shape.of(json.loads((TINY_QWEN2 / "config.json").read_text()))
    return sum(counts["Global"].values()), shape, shape.lora_params(4, list(cfg.lora.target_modules))


def test_model_flops_equal_flop_counter_on_equal_rows(tmp_path):
    counted, shape, lora = counted_flops(tmp_path, [40, 40, 40], checkpointing=False)
    model, hardware = step_flops(shape, lora, [([40, 40, 40], [40, 40, 40])], checkpointing=False)
    assert model == hardware == pytest.approx(counted, rel=1e-9)


def test_padding_counts_for_the_hardware_only(tmp_path):
    counted, shape, lora = counted_flops(tmp_path, [12, 40, 25], checkpointing=False)
    model, hardware = step_flops(shape, lora, [([12, 40, 25], [40, 40, 40])], checkpointing=False)
    assert hardware == pytest.approx(counted, rel=1e-9)  # every padded slot computed, the real tokens' share less
    assert model < 0.8 * hardware


def test_recomputation_counts_for_the_hardware_only(tmp_path):
    counted, shape, lora = counted_flops(tmp_path, [40, 40], checkpointing=True)
    model, hardware = step_flops(shape, lora, [([40, 40], [40, 40])], checkpointing=True)
    # within 0.2%: the count has 512 FLOPs per token and layer more (an adapter-sized matmul the recomputation
    # adds), against the ~29k of one more forward that the formula adds
    assert hardware == pytest.approx(counted, rel=5e-3)
    plain, _ = step_flops(shape, lora, [([40, 40], [40, 40])], checkpointing=False)
    assert model == plain < hardware


def test_forward_rows_reads_padded_chunked_and_packed_batches():
    mask = torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    batch = {"input_ids": torch.zeros_like(mask), "attention_mask": mask}
    assert forward_rows(batch, 1) == ([1, 4, 2, 1], [4, 4, 4, 4], (4, 4))
    assert forward_rows(batch, 2) == ([1, 4, 2, 1], [1, 4, 4, 1], (4, 4))  # each chunk cut to its longest row
    packed = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "lengths": torch.tensor([5, 7])}
    assert forward_rows(packed, 1) == ([5, 7, 0], [5, 7, 4], (1, 16))  # the rounding pad computes, carries nothing


def test_window_counts_only_the_timed_batches():
    log = BatchLog()
    widths = [8, 8, 4, 4, 6]  # warm-up: the first two (8 wide); the window: 4, 4, 6 (two new shapes)
    for w in widths:
        log.add({"input_ids": torch.zeros(2, w), "attention_mask": torch.ones(2, w, dtype=torch.long)})
    clock = WindowClock(warmup=2, timed=3, device=torch.device("cpu"))
    clock.start, clock.end = 10.0, 12.0
    row = window_figures(log, clock, SHAPE, 0, False, peak_tflops=1000.0)
    assert row["timed_steps"] == 3 and row["warmup_steps"] == 2
    assert row["tokens_per_s"] == (2 * 4 + 2 * 4 + 2 * 6) / 2.0
    assert row["distinct_shapes"] == 3 and row["shapes_first_seen_in_window"] == 2
    model, _ = step_flops(SHAPE, 0, [([4, 4], [4, 4]), ([4, 4], [4, 4]), ([6, 6], [6, 6])], False)
    assert row["mfu"] == round(model / 2.0 / 1e15, 4)


def test_a_window_that_never_closed_is_an_error():
    clock = WindowClock(warmup=2, timed=30, device=torch.device("cpu"))
    clock.step_done(2)
    with pytest.raises(RuntimeError, match="before its timed window"):
        _ = clock.seconds


def test_a_run_that_does_not_fit_the_measured_pace_is_skipped_without_starting(tmp_path):
    runner = Runner(tmp_path, tiny=True, warmup=1, timed=2, budget=Budget(50))
    runner.pace["ours"] = 60.0  # one lychee_exp run took a minute
    row = runner.run("hf", "lora_1p5b_2048")  # HF has no pace yet: a training run is paced by the longest one
    assert "measured pace" in row["skipped"] and "~69 s" in row["skipped"] and runner.count == 0
    runner.guess["gpu_tests"] = 30.0
    assert runner.fits("gpu_tests") is None  # not a training run: its own first guess
    runner.pace["gpu_tests"] = 80.0
    assert "skipped" in runner.fits("gpu_tests")


def tiny_model(seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY_QWEN2)))


def test_fingerprints_tell_whether_two_runs_start_from_the_same_weights():
    from peft import LoraConfig, get_peft_model

    a, b = tiny_model(0), tiny_model(0)
    assert fingerprints(a) == fingerprints(b)
    assert fingerprints(tiny_model(1))["weights"] != fingerprints(a)["weights"]
    weight = b.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        weight[0, :2] = weight[0, :2].flip(0).clone()  # two values swapped: the same sum, another tensor
    assert fingerprints(b)["weights"] != fingerprints(a)["weights"]
    torch.manual_seed(3)
    wrapped = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert fingerprints(wrapped)["weights"] == fingerprints(a)["weights"]  # peft's wrapping is not a change
    torch.manual_seed(3)
    again = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert fingerprints(again)["adapters"] == fingerprints(wrapped)["adapters"] != fingerprints(a)["adapters"]


def test_hf_groups_by_length_within_the_warmup_and_the_window():
    """Both systems time the same rows: HF's sampler reorders the warm-up slice and the window slice apart."""
    from torch.utils.data import Subset
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from benchmarks.gpu.hf_peft_run import SlicedSampler

    rows = [{"input_ids": [1] * n} for n in torch.randint(4, 400, (48,)).tolist()]
    warm = 16
    sampler = SlicedSampler(
        [LengthGroupedSampler(8, dataset=Subset(rows, range(a, b))) for a, b in ((0, warm), (warm, len(rows)))]
    )
    order = list(sampler)
    assert len(sampler) == len(order) == len(rows)
    assert sorted(order[:warm]) == list(range(warm)) and sorted(order[warm:]) == list(range(warm, len(rows)))
    assert order[warm:] != list(range(warm, len(rows)))  # reordered by length within the window


def test_profile_summary_shares_add_up():
    kernels = [
        ("flash_fwd_kernel", 0.2, 28),
        ("sm90_xmma_gemm_bf16bf16", 0.4, 300),
        ("void at::native::vectorized_elementwise_kernel", 0.1, 900),
        ("multi_tensor_apply_kernel<FusedAdam>", 0.05, 1),
        ("ncclKernel", 0.05, 2),
    ]
    summary = summarise(kernels, wall_s=1.0, steps=3, clock="device")
    share = summary["share"]
    assert share == {"attention": 0.2, "optimizer": 0.05, "gemm": 0.4, "elementwise": 0.1, "other": 0.05, "idle": 0.2}
    assert [k["name"] for k in summary["top_kernels"]][:2] == ["sm90_xmma_gemm_bf16bf16", "flash_fwd_kernel"]


def test_ablation_rows_whose_key_is_missing_are_skipped_naming_it():
    if not has_key("max_tokens_per_batch"):  # (a tree without token-budget batches)
        assert "no data.max_tokens_per_batch" in ablation_skip("x", ["data.max_tokens_per_batch=1"], False, True)
    assert (
        ablation_skip("x", ["data.nonexistent_key=1"], False, True) == "this config schema has no data.nonexistent_key"
    )
    assert ablation_skip("x", ["data.packing=false"], False, True) is None
    assert "liger" in ablation_skip("liger_kernel", ["model.liger_kernel=true"], False, False)
    names = [name for name, _, _ in ABLATION]
    assert names[:2] == ["defaults", "before"] and len(names) == len(set(names))


@pytest.fixture(scope="module")
def built_weights(tmp_path_factory) -> Runner:
    """The check's weights phase, run once for the tests that train both systems from its weights, in one served
    worker that their runs reuse, as --tiny --ablation runs its rows (test_tiny_dry_run_... keeps the dry run's
    fresh process per run; here each run's cost would be mostly its imports)."""
    runner = Runner(
        tmp_path_factory.mktemp("weights"), tiny=True, warmup=1, timed=1, budget=Budget(600), one_process=True
    )
    assert runner.build_weights()["passed"] is True
    yield runner
    if runner.served is not None:  # nothing left for it to write: no need to wait for its interpreter's exit
        runner.served.proc.kill()
        runner.served.proc.wait()


def runner_from(built: Runner, work, warmup: int, timed: int) -> Runner:
    """A runner of its own (work dir, steps) whose runs load the built weights and check their fingerprint."""
    runner = Runner(work, tiny=True, warmup=warmup, timed=timed, budget=Budget(600), one_process=True)
    runner.model_dir, runner.fingerprint, runner.served = built.model_dir, built.fingerprint, built.served
    return runner


def test_the_gpu_tests_leave_no_temporary_files(tmp_path, monkeypatch):
    """The GPU tests' own temporaries (their conftest's baseline cache, pytest's directories) go into the check's
    temporary directory, which the check removes however it ends: nothing is left in $TMPDIR. (Skipped without
    CUDA, as in the dry run: their session still starts.)"""
    scratch, work = tmp_path / "tmp", tmp_path / "work"
    scratch.mkdir()
    work.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    result = gpu_check.check_gpu_tests(300, work)
    assert result["passed"] is True, result
    assert list(scratch.iterdir()) == []


def test_ctrl_c_leaves_the_earlier_report_and_no_temporary_files(tmp_path, monkeypatch):
    """Ctrl-C as a terminal sends it (to the whole process group) once the first check passed: exit 130, one line
    and no traceback, the earlier report byte for byte, the check's temporary directory gone."""
    from test_bench_outputs import interrupt

    out, scratch = tmp_path / "gpu_check.json", tmp_path / "tmp"
    out.write_text('{"commit": "abc", "mode": "checks", "device": "H200", "checks": {}}\n')  # an earlier report
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--out", str(out)]
    code, output = interrupt(cmd, lambda printed, pid: "gpu_check: weights: PASS" in printed, cwd=REPO_ROOT)
    lines = output.splitlines()
    assert code == 130 and lines[-1] == f"gpu_check: interrupted; {out} left as it was", output[-3000:]
    assert "Traceback" not in output and not [line for line in lines if "error" in line.lower()], output[-3000:]
    assert out.read_text() == '{"commit": "abc", "mode": "checks", "device": "H200", "checks": {}}\n'
    assert [p.name for p in scratch.iterdir() if p.name.startswith("lychee")] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "tmp"]  # no staging, no lock


@pytest.mark.slow
def test_tiny_dry_run_runs_every_phase_and_writes_every_key(tmp_path):
    out, scratch = tmp_path / "gpu_check.json", tmp_path / "tmp"
    scratch.mkdir()
    # through the shell entry a GPU machine runs (from the repository root), with this interpreter
    cmd = ["bash", "benchmarks/gpu_check.sh", "--tiny", "--out", str(out)]
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(scratch)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # nothing of the check left in $TMPDIR (torch's compile cache, torchinductor_<user>, is kept by design)
    assert [p.name for p in scratch.iterdir() if p.name.startswith("lychee")] == []
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["commit"] and report["mode"] == "tiny checks"
    checks = report["checks"]
    phases = ["weights", "lora_1p5b_512", "lora_1p5b_2048", "hf_side_by_side", "gpu_tests", "matmul_ceiling"]
    assert list(checks) == phases  # required first; hf_compiled only when asked
    for name in phases:  # each phase printed its seconds as it ended
        assert re.search(rf"gpu_check: {name}: (PASS|SKIPPED) \(\d+\.\d s, \d+ s left\)", proc.stdout), name
    weights = checks["weights"]["weights_fingerprint"]
    for name in ("lora_1p5b_512", "lora_1p5b_2048"):
        row = checks[name]
        assert row["passed"] is True and row["same_weights"] is True and row["fingerprints"]["weights"] == weights
        assert row["timed_steps"] == 2 and row["tokens_per_s"] > 0 and row["distinct_shapes"] == 1
        # decided at setup: no varlen on CPU, and the dry run's prompts run through sdpa one by one
        assert row["attention"] == "sdpa_per_prompt" and row["attention_paths_seen"] == ["sdpa_per_prompt"]
        assert row["varlen_probe"]["ok"] is False and len(row["widths_seen"]) == 1
        assert row["checkpointing_why"] == "auto: CPU" and "peak_reserved_mb" in row
    for mix in ("equal_lengths", "long_tailed"):
        entry = checks["hf_side_by_side"][mix]
        assert entry["ours_tokens_per_s"] > 0 and entry["hf_tokens_per_s"] > 0 and entry["same_adapters"] is True
        assert entry["ratio"] == pytest.approx(entry["ours_tokens_per_s"] / entry["hf_tokens_per_s"], rel=1e-2)
        assert entry["rows"]["hf"]["same_weights"] is True and entry["rows"]["hf"]["attention"] == "sdpa_padded"
        assert set(entry["padding_share"]) == set(entry["real_tokens_per_step"]) == {"ours", "hf"}
    # the same weights and batches: the first step's loss is the same number in both systems, to bf16 rounding
    # (on CPU our packed prompts take segment-rows attention and an fp32 yes/no head, HF sdpa and a bf16 head:
    # 1.6e-4 measured; a wrong position or answer token moves it by ~1e-1)
    assert checks["hf_side_by_side"]["equal_lengths"]["first_loss_gap"] < 1e-3
    assert checks["hf_side_by_side"]["long_tailed"]["padding_share"]["hf"] > 0  # HF pads, lychee_exp packs
    assert checks["gpu_tests"]["passed"] is True  # every GPU test skipped cleanly without CUDA
    assert "tests/test_gpu_packing.py" in checks["gpu_tests"]["files"]


@pytest.mark.slow
def test_tiny_ablation_dry_run(tmp_path):
    out = tmp_path / "ablation.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--ablation", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    ablation = report["checks"]["ablation"]
    rows = ablation["rows"]
    assert list(rows) == [name for name, _, _ in ABLATION] and report["mode"] == "tiny ablation"
    assert rows["defaults"]["vs_defaults"] == 1.0 and rows["defaults_512"]["vs_defaults"] == 1.0
    for name, row in rows.items():
        assert "skipped" in row or (row["vs_defaults"] > 0 and row["same_weights"] is True), name
    assert rows["before"]["gradient_checkpointing"] is True and rows["before"]["attention"] == "sdpa_padded"
    assert rows["no_packing"]["padding_share"] >= 0 and "skipped" in rows["compile_layers"]
    share = ablation["profile"]["share"]
    assert set(share) == {"attention", "gemm", "elementwise", "optimizer", "other", "idle"}
    assert sum(share.values()) == pytest.approx(1.0, abs=1e-3) and ablation["profile"]["top_kernels"]


@pytest.mark.slow
def test_lychee_exp_and_hf_trainer_do_the_same_math(built_weights, tmp_path):
    """Without LoRA dropout (whose masks come from different random streams) the two systems' losses agree step
    after step: same weights, batches, loss, AdamW settings, schedule and clipping."""
    runner = runner_from(built_weights, tmp_path, warmup=1, timed=4)
    # one forward per batch, as HF does: forward chunks are other bf16 GEMM shapes (losses apart by ~3e-4)
    rows = [
        runner.run(system, "lora_1p5b_2048", overrides=["model.lora.dropout=0.0", "trainer.forward_chunks=1"])
        for system in ("ours", "hf")
    ]
    ours, hf = (row["first_losses"] for row in rows)
    assert len(ours) == len(hf) == 5
    assert ours[0] == pytest.approx(hf[0], rel=1e-4)  # step 1: the same weights, batch and loss
    # then within 1e-3 (measured: 2.3e-4): lychee_exp reads the yes/no logit in fp32 (model.answer_head), HF from
    # its bf16 LM head's logits, so the gradients, and the weights after step 1, differ in their low bits
    assert ours == pytest.approx(hf, rel=1e-3)
    assert len(set(ours)) == 5  # the losses move: the comparison is not of a model that does not train


@pytest.mark.slow
def test_hf_times_the_rows_of_lychee_exps_window(built_weights, tmp_path):
    """On the long-tailed mix under its token budget, HF's timed rows are the prompts of lychee_exp's timed
    micro-batches (compared as the multiset of prompt lengths its loader yields), its warm-up a separate slice."""
    import dataclasses

    from benchmarks.gpu import hf_peft_run, lychee_lora_run
    from lychee_exp.parallel.devices import plan_devices
    from lychee_exp.parallel.distributed import DistEnv
    from lychee_exp.train.trainer import Trainer

    runner = runner_from(built_weights, tmp_path, warmup=2, timed=3)
    mix = runner.mixes["long_tailed"]
    spec = {"system": "ours", "seed": 42, "model_dir": str(runner.model_dir), "packing": "auto", "warmup": 2,
            "timed": 3, "data": str(runner.data(mix, 2)), "mix": dataclasses.asdict(mix)}  # fmt: skip
    cfg = lychee_lora_run.compose(spec, tmp_path / "ours")
    trainer = Trainer(cfg, DistEnv(), plan_devices("single", 1, cpu_threads_per_rank=1), tmp_path / "ours")
    trainer.setup()
    try:
        loader = iter(trainer.data.loader)
        batches = [next(loader) for _ in range(5)]
    finally:
        trainer.cleanup()
    window = sorted(n for b in batches[2:] for n in b["lengths"].tolist())
    hf_cfg = lychee_lora_run.compose({**spec, "system": "hf"}, tmp_path / "hf")
    rows, _, _, warm_steps, timed_steps = hf_peft_run.pairs(hf_cfg, 2, 3)
    per = cfg.data.batch_size * cfg.data.train_group_size
    hf_window = sorted(len(r["input_ids"]) for r in rows[warm_steps * per :])
    assert warm_steps == 2 and timed_steps == len(hf_window) // per >= 1
    if has_key("max_tokens_per_batch"):
        assert len(window) - per < len(hf_window) <= len(window)  # cut to whole HF steps
        assert not Counter(hf_window) - Counter(window)  # every HF row is one of lychee_exp's window
    else:
        assert hf_window == window
