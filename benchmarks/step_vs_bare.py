"""lychee_exp's training step against a bare PyTorch loop on the same pairs, profiled per operator group.

    python -m benchmarks.step_vs_bare [--precision fp32|bf16] [--steps 4] [overrides]

Builds lychee_exp's Trainer for the peer benchmark's sample mix (benchmarks.peers: the MiniLM cross-encoder, the
Lychee prompt's text, 8 queries x 4 documents = 32 pairs a step, `parallel=single`, its defaults otherwise: packed
rows on CPU) and takes its first batches; the bare loop gets the same pairs as padded rows (the attention mask and
token types a tokenizer writes) on a fresh copy of the model (transformers' AutoModelForSequenceClassification,
dropout 0, fused AdamW, clipping at 1.0). Each side runs 2 warm-up steps, then `--steps` steps under
torch.profiler: forward, backward and the optimizer step. Prints self CPU milliseconds per 1000 non-pad tokens by
operator group, side by side: where one step spends more than the other. This is the profile behind issue 55.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.peers import MIXES, SETTINGS
from lychee_exp.config.schema import to_run_config
from lychee_exp.job.in_process import compose_job
from lychee_exp.model.reranker import model_dir
from lychee_exp.parallel.devices import plan_devices
from lychee_exp.parallel.distributed import DistEnv
from lychee_exp.train.optim import optimizer_step
from lychee_exp.train.trainer import Trainer

GROUPS = {
    "matmul (mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention forward": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "attention backward": ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",),
    "copy_ (casts, contiguous)": ("aten::copy_",),
    "fill_, zero_": ("aten::fill_", "aten::zero_"),
    "add, mul (in place or not)": ("aten::add_", "aten::add", "aten::mul", "aten::mul_"),
    "gelu forward + backward": ("aten::gelu", "aten::gelu_backward"),
    "layer norm forward + backward": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
    "index, gather, masked fill": ("aten::index", "aten::_index_put_impl_", "aten::index_select", "aten::masked_fill_"),
    "softmax forward + backward": ("aten::_softmax", "aten::_softmax_backward_data"),
    "cat": ("aten::cat",),
    "optimizer (fused AdamW, norms)": ("aten::_fused_adamw_", "aten::linalg_vector_norm"),
}


def padded_rows(batch: dict, pad_id: int, sep_id: int) -> dict:
    """A packed row's prompts as right-padded rows with their attention mask and token types."""
    ids, bounds = batch["input_ids"][0], batch["cu_seqlens"].tolist()[: batch["last_index"].shape[0] + 1]
    prompts = [ids[start:end] for start, end in zip(bounds[:-1], bounds[1:])]
    rows = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=pad_id)
    mask = (torch.arange(rows.shape[1])[None] < torch.tensor([len(p) for p in prompts])[:, None]).long()
    is_sep = (rows == sep_id).long()
    types = ((is_sep.cumsum(-1) - is_sep) > 0).long() * mask
    return {"input_ids": rows, "attention_mask": mask, "token_type_ids": types}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0], usage=__doc__.strip().splitlines()[2]
    )
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="both sides' precision")
    parser.add_argument("--steps", type=int, default=4, help="steps profiled on each side")
    args, overrides = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="lychee-step-vs-bare-"))
    run = [*SETTINGS, *MIXES["sample"], "parallel=single", "gpus=1", "data.batch_size=8", *overrides]
    run += [f"trainer.precision={args.precision}", "trainer.evaluate=false", "logger=none", "trainer.max_steps=100"]
    cfg = to_run_config(compose_job(run, out))
    plan = plan_devices("single", 1)
    torch.set_num_threads(plan.threads_per_rank)
    trainer = Trainer(cfg, DistEnv(), plan, out)
    trainer.setup()
    if trainer.cfg.data.packing is not True:
        raise SystemExit("this comparison takes lychee_exp's packed rows (a BERT-family cross-encoder on CPU)")
    loader = iter(trainer.data.loader)
    batches = [next(loader) for _ in range(args.steps + 2)]
    from transformers import AutoModelForSequenceClassification

    bare = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir(cfg.model)), num_labels=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    ).train()
    bare_optimizer = torch.optim.AdamW(bare.parameters(), lr=cfg.optimizer.lr, weight_decay=0.0, fused=True)
    padded = [padded_rows(b, trainer.encoder.pad_id, trainer.tokenizer.sep_token_id) for b in batches]
    trainer.train_model.train()

    def lychee_step(batch: dict) -> int:
        kwargs, tokens, _ = trainer.step._model_inputs(batch)
        with trainer.step.autocast():
            per_query, _ = trainer.loss_fn(trainer.train_model(batch["input_ids"], **kwargs), None)
        per_query.sum().backward()
        optimizer_step(trainer.model, trainer.optimizer, trainer.scheduler, trainer.scaler, cfg.optimizer)
        return tokens

    def bare_step(rows: dict) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = bare(**rows).logits[:, 0].float()
        torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.zeros_like(logits)).backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), cfg.optimizer.max_grad_norm)
        bare_optimizer.step()
        bare_optimizer.zero_grad(set_to_none=True)
        return int(rows["attention_mask"].sum())

    per_1k, wall = {}, {}
    for name, step, inputs in (("lychee_exp", lychee_step, batches), ("bare loop", bare_step, padded)):
        for item in inputs[:2]:
            step(item)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start, tokens = time.perf_counter(), sum(step(item) for item in inputs[2:])
        wall[name] = (time.perf_counter() - start) * 1e6 / tokens
        per_1k[name] = {e.key: e.self_cpu_time_total / tokens for e in prof.key_averages()}  # us/token = ms/1000
    padding = 1 - sum(int(r["attention_mask"].sum()) for r in padded[2:]) / sum(
        r["input_ids"].numel() for r in padded[2:]
    )
    print(f"{args.precision}, {args.steps} steps of 32 pairs; the bare loop's rows {padding:.0%} padding")
    print("self CPU ms per 1000 non-pad tokens:\n| operator group | lychee_exp | bare loop |\n|---|---|---|")
    for group, keys in GROUPS.items():
        print(f"| {group} | " + " | ".join(f"{sum(per_1k[n].get(k, 0.0) for k in keys):.1f}" for n in per_1k) + " |")
    print("| all operators | " + " | ".join(f"{sum(per_1k[n].values()):.1f}" for n in per_1k) + " |")
    print("| wall clock (profiled) | " + " | ".join(f"{wall[n]:.1f}" for n in wall) + " |")


if __name__ == "__main__":
    main()
