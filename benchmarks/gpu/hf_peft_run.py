"""The same LoRA training as Hugging Face's docs would have a user set it up: transformers.Trainer + peft on the
same model (the check's weights, loaded with from_pretrained: bf16, sdpa), the same LoRA config (peft's defaults
otherwise: float32 adapters), the same pre-tokenized pairs (the rows lychee_exp's sampler draws, in its order), the
same yes/no loss read at the last position with logits_to_keep=1 (the whole vocabulary's logits there, as a HF
user writes it: lychee_exp's model.answer_head computes only the yes/no rows), the same AdamW settings (fused, as
`optim="adamw_torch_fused"`), schedule and clipping. Gradient checkpointing is HF's own decision: the rule behind
lychee_exp's `auto` applied to what HF holds (its widest padded batch, peft's float32 adapter path).

On the long-tailed mix HF's group_by_length sampler reorders rows, within two slices: the warm-up steps' rows and
the timed window's rows, so that both systems time the same rows (a sampler over the whole list would spend its
warm-up on the longest rows of its first mega-batch). `compile: true` adds TrainingArguments(torch_compile=True)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.data import Sampler, Subset

from benchmarks.gpu.flops import bf16_peak_tflops
from benchmarks.gpu.lychee_lora_run import FIRST_LOSSES, compose, shape_of
from benchmarks.gpu.timing import BatchLog, WindowClock, peak_memory, window_figures
from benchmarks.gpu.weights import starting_point


def lychee_batches(cfg, groups, encoder, count: int) -> list[list[tuple[int, int]]]:
    """(epoch, query) of each of lychee_exp's first `count` micro-batches in one process: its fixed batches, or
    its token-budget plan (data.budget, a function of the seed) epoch after epoch."""
    from lychee_exp.data.sampling import train_sampler

    data = cfg.data
    if getattr(data, "max_tokens_per_batch", None):
        from lychee_exp.data.budget import TokenBudgetSampler

        plan = TokenBudgetSampler(groups, encoder, data, 1, 1, 0, cfg.seed).plan
        batches, epoch = [], 0
        while len(batches) < count:
            batches += [[(epoch, q) for q in b] for b in plan(epoch) if b]
            epoch += 1
        return batches[:count]
    order = list(train_sampler(groups, encoder, data.bucket_by_length, data.bucket_pool_batches,
                               data.batch_size, 1, 0, cfg.seed))  # fmt: skip
    fixed = [[(0, q) for q in order[k * data.batch_size : (k + 1) * data.batch_size]] for k in range(count)]
    return [b for b in fixed if b]


def pairs(cfg, warmup: int, timed: int) -> tuple[list[dict], object, tuple[int, int], int, int]:
    """HF's rows, unpadded, with labels (1 for each group's positive), pre-tokenized as a HF user pre-tokenizes a
    dataset (lychee_exp's groups and prompt encoder), and HF's warm-up and timed step counts. HF takes
    data.batch_size queries a step. Its window: the queries of lychee_exp's timed micro-batches (its sampler or
    token-budget plan), cut to a multiple of that (where a token budget made the count uneven, fewer than one HF
    step's worth are left out). Its warm-up: a separate slice of `warmup` steps, lychee_exp's warm-up queries then
    those after its window."""
    from lychee_exp.data.groups import TrainGroups
    from lychee_exp.model.reranker import answer_token_ids
    from lychee_exp.train.inputs import load_inputs

    inputs = load_inputs(cfg, warn_unknown=False)
    data = cfg.data
    instruction = data.instruction or cfg.model.prompt.default_instruction
    groups = TrainGroups(inputs.train_queries, data.train_group_size, instruction, cfg.seed, data.random_negatives)
    batches = lychee_batches(cfg, groups, inputs.encoder, 2 * warmup + timed)
    per = data.batch_size
    flat = lambda part: [q for b in part for q in b]  # noqa: E731
    window = flat(batches[warmup : warmup + timed])
    window = window[: len(window) // per * per]
    warm = (flat(batches[:warmup]) + flat(batches[warmup + timed :]))[: warmup * per]
    if len(warm) < warmup * per or not window:
        raise RuntimeError(f"too few queries for HF's {warmup} warm-up steps or its window ({per} queries a step)")
    rows = []
    for epoch, index in warm + window:
        groups.set_epoch(epoch)
        instr, query, docs, _ = groups[index]
        rows += [
            {"input_ids": inputs.encoder.encode(instr, query, doc), "labels": float(k == 0)}
            for k, doc in enumerate(docs)
        ]
    return rows, inputs.encoder, answer_token_ids(cfg.model, inputs.encoder), warmup, len(window) // per


def own_checkpointing(cfg, encoder, rows: list[dict], device: torch.device) -> tuple[bool, str]:
    """HF's checkpointing from its own need: memory_plan's rule for `auto` with HF's rows per step at the widest
    row of the run (the widest batch it pads to) and peft's float32 adapter path."""
    from lychee_exp.parallel.memory_plan import resolve_checkpointing

    widest = max(len(r["input_ids"]) for r in rows)
    model = dataclasses.replace(
        cfg.model,
        gradient_checkpointing="auto",
        prompt=dataclasses.replace(cfg.model.prompt, max_len=widest),
        lora=dataclasses.replace(cfg.model.lora, dtype="float32"),
    )
    hf_cfg = dataclasses.replace(cfg, model=model)
    return resolve_checkpointing(hf_cfg, SimpleNamespace(prompt=model.prompt), device)


class SlicedSampler(Sampler):
    """One sampler per consecutive slice of the dataset, in turn, each slice's indices offset to its start."""

    def __init__(self, samplers: list):
        self.samplers = samplers

    def __iter__(self):
        start = 0
        for sampler in self.samplers:
            yield from (start + i for i in sampler)
            start += len(sampler)

    def __len__(self) -> int:
        return sum(len(s) for s in self.samplers)


def training_args(cfg, spec: dict, out: Path, rows: int, steps: int, checkpointing: bool, cuda: bool):
    from transformers import TrainingArguments

    from lychee_exp.config.auto import scaled_lr

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    opt = cfg.optimizer
    args = {
        "output_dir": str(out / "hf"),
        "per_device_train_batch_size": rows,
        "max_steps": steps,
        "learning_rate": scaled_lr(cfg, 1),  # the rate lychee_exp trains with (optimizer.lr_scaling applied)
        "weight_decay": opt.weight_decay,
        "adam_beta1": opt.betas[0],
        "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps,
        "max_grad_norm": opt.max_grad_norm,
        "lr_scheduler_type": "linear",
        "warmup_steps": math.ceil(opt.warmup_ratio * steps),  # lychee_exp's rounding of the same ratio
        "optim": "adamw_torch_fused",
        "bf16": True,
        "gradient_checkpointing": checkpointing,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "torch_compile": bool(spec.get("compile")),
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "remove_unused_columns": False,
        "seed": cfg.seed,
        "use_cpu": not cuda,
    }
    if spec.get("group_by_length"):  # transformers >= 5.2x names it train_sampling_strategy
        if "train_sampling_strategy" in fields:
            args["train_sampling_strategy"] = "group_by_length"
        else:
            args["group_by_length"] = True
    return TrainingArguments(**{k: v for k, v in args.items() if k in fields})


def run(spec: dict, out: Path) -> dict:
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import SequentialSampler
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback

    from lychee_exp.model.reranker import model_dir

    cfg = compose(spec, out)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rows, encoder, (yes_id, no_id), warmup, timed = pairs(cfg, spec["warmup"], spec["timed"])
    steps = warmup + timed
    per_step = cfg.data.batch_size * cfg.data.train_group_size
    checkpointing, why = own_checkpointing(cfg, encoder, rows, device)

    torch.manual_seed(cfg.seed)  # as load_reranker: the same draws give the same adapters
    config = AutoConfig.from_pretrained(str(model_dir(cfg.model)))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir(cfg.model)), config=config, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    lora = cfg.model.lora
    peft_config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config).to(device)
    started_from = starting_point(model)
    log, losses = BatchLog(), []
    clock = WindowClock(warmup, timed, device)

    def collate(batch_rows: list[dict]) -> dict:
        batch = encoder.pad([r["input_ids"] for r in batch_rows])  # left padding, as lychee_exp pads
        log.add(batch)
        batch["labels"] = torch.tensor([r["labels"] for r in batch_rows])
        return batch

    class YesNoTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs, logits_to_keep=1, use_cache=False)
            last = out.logits[:, -1, :].float()
            loss = F.binary_cross_entropy_with_logits(last[:, yes_id] - last[:, no_id], labels.float())
            if len(losses) < FIRST_LOSSES:
                losses.append(loss.detach())
            return (loss, out) if return_outputs else loss

        def _get_train_sampler(self, *args, **kwargs):
            if spec.get("group_by_length"):  # HF's own sampler, on the warm-up slice, then on the window's rows
                return SlicedSampler([super(YesNoTrainer, self)._get_train_sampler(part) for part in slices])
            return SequentialSampler(self.train_dataset)  # lychee_exp's batches, in its order

    warm = warmup * per_step
    slices = [Subset(rows, range(warm)), Subset(rows, range(warm, len(rows)))]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_done(state.global_step)

    args = training_args(cfg, spec, out, per_step, steps, checkpointing, cuda)
    YesNoTrainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[Clock()]).train()
    shape, lora_params = shape_of(cfg)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    row = window_figures(log, clock, shape, lora_params, checkpointing, bf16_peak_tflops(name))
    row.update(peak_memory(device))
    row.update(
        {
            "system": "hf_trainer_compiled" if spec.get("compile") else "hf_trainer",
            "fingerprints": started_from,
            "attention": "sdpa_padded",
            "first_losses": [round(float(x), 5) for x in losses],
            "gradient_checkpointing": checkpointing,
            "checkpointing_why": why,
            "group_by_length": bool(spec.get("group_by_length")),
            "rows_per_step": per_step,
        }
    )
    return row
