"""The reranker: a transformers backbone that turns a Lychee prompt into one relevance logit.

For a causal LM (Lychee, Qwen2, Qwen3-Reranker) the logit is logit(yes) - logit(no) at the last position of a
left-padded batch, so sigmoid(logit) = softmax over (yes, no) = p(yes); with `model.score: yes_logit` it is the raw
yes logit, as FlagEmbedding's decoder-only rerankers score. Only the LM head's yes/no rows are computed
(model.answer_head), not the whole vocabulary's logits. A sequence classifier (the MiniLM cross-encoder) has
one logit that plays the same role. Losses and rankings use this logit; `probability` gives sigmoid of it.

Speed levers of the model on its device (apply_levers): the LoRA adapters' dtype path, Liger kernels and
torch.compile of the decoder layers (the last two off unless asked for); they run after the model is on its device
and the precision is known, before DDP wraps it (`auto` checkpointing is decided before the model is built, from
parallel.memory_plan's estimate).
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lychee_exp.config.choices import ModelKind, Pooling
from lychee_exp.config.schema import ModelConfig
from lychee_exp.data.packing import BOUNDS, CU_SEQLENS, MAX_LENGTH, PACKED_PREFIX
from lychee_exp.data.pair_prompt import PairEncoder, TextsApartEncoder, pair_max_len, token_types
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.errors import RunFailed, UserError, write_failure
from lychee_exp.io.outputs import staged_directory
from lychee_exp.io.user_files import resolve_path
from lychee_exp.model.answer_head import answer_logits
from lychee_exp.model.bi_encoder import (
    bi_encoder_logits,
    bi_encoder_packed_logits,
    check_pair_split,
    freeze_pooler,
    text_vectors,
    write_sentence_transformers_files,
)
from lychee_exp.model.files import (
    ADAPTER_DIR,
    check_config_json,
    check_tokenizer_files,
    check_weights,
    has_weights,
    match_umask,
    new_head_allowed,
    write_card,
)
from lychee_exp.model.model_card import RunRecord, base_model_name, name_adapter_base, write_model_card
from lychee_exp.model.packed import packed_attention, score_packed_encoder
from lychee_exp.model.precision import weight_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackboneKind:
    """How one model.kind loads its backbone and reads a score from it."""

    auto_class: str  # the transformers Auto class that loads it
    # causal LMs answer at the last position, so rows must end together; BERT's absolute positions want right
    padding_side: str
    lora_task_type: str
    num_labels: int | None  # a classification head with this many logits (None: the LM head)
    yes_no: bool  # the score is logit(yes) - logit(no) of the next token


KINDS = {
    ModelKind.causal_lm: BackboneKind("AutoModelForCausalLM", "left", "CAUSAL_LM", None, yes_no=True),
    ModelKind.sequence_classification: BackboneKind(
        "AutoModelForSequenceClassification", "right", "SEQ_CLS", 1, yes_no=False
    ),
    ModelKind.bi_encoder: BackboneKind("AutoModel", "right", "FEATURE_EXTRACTION", None, yes_no=False),
}


class Reranker(nn.Module):
    def __init__(
        self,
        backbone: nn.Module,
        kind: str,
        yes_id: int | None = None,
        no_id: int | None = None,
        score: str = "yes_minus_no",
        sep_id: int | None = None,
        pooling: Pooling = Pooling.mean,
    ):
        super().__init__()
        self.backbone = backbone
        self.kind = kind
        self.yes_id, self.no_id = yes_id, no_id
        self.score = score
        self.sep_id = sep_id  # text pairs: token_type_ids are derived from the first separator of each row
        self.pooling = pooling  # bi_encoder: how token states become one vector

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        chunks: list[tuple[list[int], int]] | None = None,
        packed: dict | None = None,
        max_tokens: int | None = None,
        texts: bool = False,
    ) -> torch.Tensor:
        """One relevance logit per row; `texts` (bi-encoders: scoring each text once, ir.evaluate): the rows are
        single texts, and each gets its unit vector (model.bi_encoder.text_vectors) instead. `chunks` (from
        bucketing.length_chunks): score the rows in groups of similar length, each cut to its own width, so that
        fewer padding slots are computed; every row's logit is the same as in one pass (positions count real tokens,
        padding is masked), in the rows' order.
        `packed` (data.packing.pack, without its input_ids): input_ids is one packed row; one logit per prompt
        (encoder cross-encoders: model.packed). `max_tokens` (scoring, ir.evaluate; bi-encoders): at most this many
        token slots per backbone forward (bi_encoder.row_parts: equal parts of rows at each side's width), so that
        a long batch's activations are held a part at a time, with the logits of one pass (tests/test_phase_memory.py).
        Other kinds score a batch whole: cut into parts, a cross-encoder's fp32 logits moved in their last bits here,
        which could move the default job's figures."""
        if texts:  # through forward: FSDP and DDP wrap forward, not the backbone's own call
            return text_vectors(self.backbone, input_ids, attention_mask, self.pooling, max_tokens)
        if packed is not None:
            return self._score_packed(input_ids, packed)
        if max_tokens:
            return self._score(input_ids, attention_mask, max_tokens)
        if not chunks or len(chunks) == 1:
            return self._score(input_ids, attention_mask)
        width = input_ids.shape[1]
        parts, order = [], []
        for rows, chunk_width in chunks:
            index = torch.tensor(rows, device=input_ids.device)
            cols = (
                slice(width - chunk_width, width) if KINDS[self.kind].padding_side == "left" else slice(0, chunk_width)
            )
            parts.append(self._score(input_ids[index, cols], attention_mask[index, cols]))
            order += rows
        inverse = torch.argsort(torch.tensor(order, device=input_ids.device))
        return torch.cat(parts)[inverse]

    def _score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_tokens: int | None = None):
        if self.kind == "bi_encoder":  # parts cut after the pair's split: each side at its own width
            return bi_encoder_logits(self.backbone, input_ids, attention_mask, self.sep_id, self.pooling, max_tokens)
        if self.kind == "sequence_classification":
            types = (
                {} if self.sep_id is None else {"token_type_ids": token_types(input_ids, attention_mask, self.sep_id)}
            )
            logits = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **types).logits
            return logits[:, 0].float().clone()  # not a view: FSDP2 hooks the output for its backward
        # Positions count real tokens only, so a left-padded row is computed exactly as it would be alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return self._answer(1, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    def _score_packed(self, input_ids: torch.Tensor, packed: dict) -> torch.Tensor:
        config = self.backbone.config
        if not config._attn_implementation.startswith(PACKED_PREFIX):
            raise ValueError("a packed batch needs a reranker loaded with packing=True (load_reranker)")
        if self.kind == "bi_encoder":  # each pair repacked as its two texts
            return bi_encoder_packed_logits(self.backbone, input_ids, packed, self.sep_id, self.pooling)
        if not KINDS[self.kind].yes_no:  # an encoder cross-encoder: each prompt's [CLS] through the classifier
            return score_packed_encoder(self.backbone, input_ids, packed, self.sep_id)
        # A prepared mask per layer type skips transformers' mask building (and its device read): the packed
        # attention confines each prompt to itself from the segment boundaries.
        masks = dict.fromkeys(getattr(config, "layer_types", None) or ["full_attention"])
        return self._answer(
            packed["last_index"],  # only the prompts' last tokens are scored
            input_ids=input_ids,
            attention_mask=masks,
            position_ids=packed["position_ids"],
            **{CU_SEQLENS: packed["cu_seqlens"], MAX_LENGTH: packed["max_length"], BOUNDS: packed["bounds"]},
        )

    def _answer(self, keep: int | torch.Tensor, **inputs) -> torch.Tensor:
        """The relevance logit at the kept positions from the LM head's yes/no rows (model.answer_head)."""
        no_id = None if self.score == "yes_logit" else self.no_id
        return answer_logits(self.backbone, keep, self.yes_id, no_id, use_cache=False, **inputs)

    @torch.inference_mode()
    def probability(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """p(yes): softmax over the yes/no logits, i.e. sigmoid of the relevance logit."""
        return torch.sigmoid(self(input_ids, attention_mask))


def padding_side(cfg: ModelConfig) -> str:
    return KINDS[cfg.kind].padding_side


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    path = model_dir(cfg)
    check_tokenizer_files(path, f"model.path={cfg.path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # a damaged tokenizer_config.json, ...
        text = str(err).strip().splitlines()
        raise UserError(
            f"model.path={cfg.path}: transformers cannot build a tokenizer from {path} "
            f"({type(err).__name__}: {text[0] if text else ''})"
        ) from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise UserError(f"model.path={cfg.path}: the tokenizer has neither a pad nor an eos token to pad with")
    return tokenizer


def model_dir(cfg: ModelConfig) -> Path:
    path = resolve_path(cfg.path, "model.path")
    if (path / "state.pt").is_file() and not (path / "config.json").is_file():  # train/checkpoint.py's layout
        raise UserError(
            f"model.path={cfg.path}: a training checkpoint (trainable weights and optimizer state only): use the "
            "run's model/ directory, written when training ends (continue the run with trainer.resume=auto)"
        )
    if not (path / "config.json").is_file():
        raise UserError(f"model.path={cfg.path}: {path} has no config.json (expected a transformers model directory)")
    check_config_json(path, f"model.path={cfg.path}")
    return path


def check_model_weights(cfg: ModelConfig) -> None:
    """model.path holds whole weights that fit its config.json (unless random_init asks for none): one line
    naming the directory, never training or scoring from weights that were never there."""
    path = model_dir(cfg)
    if not has_weights(path):
        raise UserError(
            f"model.path={cfg.path}: no weights in {path} (no *.safetensors or *.bin): give a directory holding a "
            "model's weights (a run's <run>/model), or set model.random_init=true to initialise this architecture "
            "from scratch"
        )
    check_weights(path, f"model.path={cfg.path}")


def build_encoder(cfg: ModelConfig, tokenizer) -> PromptEncoder:
    if cfg.kind == "bi_encoder":
        encoder = TextsApartEncoder(tokenizer, cfg.prompt, padding_side(cfg))
        encoder.sep_id = check_pair_split(tokenizer)  # where the model cuts each row into its two texts
        return encoder
    if uses_text_pairs(cfg):
        return PairEncoder(tokenizer, cfg.prompt, padding_side(cfg))
    return PromptEncoder(tokenizer, cfg.prompt, padding_side(cfg))


def uses_text_pairs(cfg: ModelConfig) -> bool:
    return not KINDS[cfg.kind].yes_no and cfg.prompt.text_pair


def load_reranker(
    cfg: ModelConfig, encoder: PromptEncoder, seed: int, packing: bool = False, training: bool = False
) -> Reranker:
    """Loads (or, with random_init, freshly initialises) the backbone and wraps it; LoRA when enabled.
    `packing`: attention that also takes packed rows (data.packing); padded batches score as before.
    Weights the directory lacks are an error, unless `training` starts from a base model that is not a
    reranker of this kind (model.files.new_head_allowed): then its new head is trained."""
    import transformers

    transformers.logging.set_verbosity_error()  # the loading report is read below instead of printed
    transformers.logging.disable_progress_bar()
    path = str(model_dir(cfg))
    kind = KINDS[cfg.kind]
    auto_cls = getattr(transformers, kind.auto_class)
    extra = {"num_labels": kind.num_labels} if kind.num_labels else {}
    attention = cfg.attn_implementation
    if packing:  # check_config has refused other model kinds and attention implementations
        attention = packed_attention(attention)
    kwargs = {"dtype": weight_dtype(cfg.dtype), "attn_implementation": attention}
    torch.manual_seed(seed)  # random_init weights and new heads are part of the seeded run
    config = transformers.AutoConfig.from_pretrained(path, **extra)
    if cfg.dropout is not None:
        for key, value in config.to_dict().items():
            if "dropout" in key and isinstance(value, float):
                setattr(config, key, cfg.dropout)
    if cfg.random_init:
        backbone = auto_cls.from_config(config, **kwargs)
    else:
        check_model_weights(cfg)
        backbone, report = auto_cls.from_pretrained(path, config=config, output_loading_info=True, **kwargs)
        _check_loaded(cfg, report, training)
    if packing and set(getattr(backbone.config, "layer_types", None) or []) - {"full_attention"}:
        raise UserError(f"data.packing: model.path={cfg.path} has sliding-window layers, which packing does not handle")
    if backbone.config.pad_token_id is None:
        backbone.config.pad_token_id = encoder.pad_id
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen (LoRA) inputs without enable_input_require_grads.
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.kind == "bi_encoder":
        freeze_pooler(backbone)
    if cfg.lora.enabled:
        backbone = add_lora(backbone, cfg)
    yes_id, no_id = answer_token_ids(cfg, encoder)
    return Reranker(backbone, cfg.kind, yes_id, no_id, cfg.score, getattr(encoder, "sep_id", None), cfg.pooling)


def answer_token_ids(cfg: ModelConfig, encoder: PromptEncoder) -> tuple[int | None, int | None]:
    """The yes/no token ids the score reads (each must be one token: else one line naming the key)."""
    if not KINDS[cfg.kind].yes_no:
        return None, None
    yes_id = encoder.single_token_id("model.prompt.yes_token", cfg.prompt.yes_token)
    if cfg.score == "yes_logit":
        return yes_id, None
    return yes_id, encoder.single_token_id("model.prompt.no_token", cfg.prompt.no_token)


def add_lora(backbone: nn.Module, cfg: ModelConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in backbone.named_modules()}
    missing = [m for m in cfg.lora.target_modules if m not in names]
    if missing:
        raise UserError(f"model.lora.target_modules: {missing} not found in the model")
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type=KINDS[cfg.kind].lora_task_type,
    )
    with warnings.catch_warnings():
        # peft 0.21's PeftModel reads the model's is_gradient_checkpointing, which transformers 5 deprecates with a
        # FutureWarning on every LoRA model (plan, each rank): peft's to change, nothing of ours reads it
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(backbone, lora)


def count_parameters(module: nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return total, trainable


def _check_loaded(cfg: ModelConfig, report: dict, training: bool) -> None:
    fresh = list(report.get("missing_keys", [])) + [str(k[0]) for k in report.get("mismatched_keys", [])]
    if fresh and not new_head_allowed(cfg, training):
        shown = ", ".join(sorted(fresh)[:3]) + (", ..." if len(fresh) > 3 else "")
        raise UserError(
            f"model.path={cfg.path}: loaded as model.kind={cfg.kind}, {len(fresh)} weight(s) would be freshly "
            f"initialised ({shown}); give a directory holding a trained reranker of this kind"
        )


def save_reranker(
    reranker: Reranker,
    tokenizer,
    cfg: ModelConfig,
    out_dir: Path,
    ranking: dict | None = None,
    run: RunRecord | None = None,
    keep_adapter: bool = False,
) -> None:
    """Saves a plain transformers model (LoRA merged in) plus tokenizer, the lychee_exp card (model.files) and the
    Hugging Face model card README.md (model.model_card), loadable with model.path=out_dir; a LoRA run also keeps
    its peft adapter in out_dir/adapter, whose base_model_name_or_path is the directory training started from.
    `ranking`: how the run ranked its dev set beyond the model's own scores (a teacher mix, ir.fusion), recorded
    for rerank; `run`: the run that trained the model (its config and final metrics), for README.md's figures.
    A LoRA model's adapters are merged into its backbone, which then replaces the PeftModel in `reranker`; with
    keep_adapter (a run that goes on using its adapters: its final evaluation, the best's restored) into a copy.

    Written whole or not at all: into a hidden directory beside out_dir, moved into place once complete
    (io.outputs.staged_directory: an earlier out_dir, a resumed run's, stays until then). Every file gets the
    permissions of the user's umask. A write that fails (a full disk) removes the hidden directory and is one line
    (RunFailed)."""
    try:
        with staged_directory(out_dir) as staging:
            _write_reranker(reranker, tokenizer, cfg, staging, ranking, run, keep_adapter)
            match_umask(staging)
    except BaseException as err:
        reason = write_failure(err)
        if reason is not None:
            # read after the failure: a failed move has put an earlier model/ back
            kept = f"{out_dir} left as it was" if out_dir.exists() else "nothing written there"
            raise RunFailed(f"saving the model to {out_dir} failed: {reason}; {kept}", "crashed") from err
        raise


def _write_reranker(
    reranker: Reranker,
    tokenizer,
    cfg: ModelConfig,
    out_dir: Path,
    ranking: dict | None,
    run: RunRecord | None,
    keep_adapter: bool = False,
) -> None:
    from peft import PeftModel

    backbone = reranker.backbone
    base = _card_base(cfg)
    adapter = isinstance(backbone, PeftModel)
    if adapter:
        for peft_config in backbone.peft_config.values():
            if not cfg.random_init:
                peft_config.base_model_name_or_path = str(model_dir(cfg).resolve())
        backbone.save_pretrained(str(out_dir / ADAPTER_DIR))
        name_adapter_base(out_dir / ADAPTER_DIR, base)
        if keep_adapter:  # a copy of the model's size, freed after the save
            backbone = copy.deepcopy(backbone).merge_and_unload()
        else:
            backbone = backbone.merge_and_unload()
            reranker.backbone = backbone
    backbone.save_pretrained(str(out_dir), safe_serialization=True)
    if uses_text_pairs(cfg):  # where sentence-transformers' CrossEncoder reads the pair's budget
        tokenizer.model_max_length = pair_max_len(tokenizer, cfg.prompt)
    tokenizer.save_pretrained(str(out_dir))
    if cfg.kind == "bi_encoder":
        hidden = backbone.config.hidden_size
        write_sentence_transformers_files(out_dir, hidden, cfg.pooling, pair_max_len(tokenizer, cfg.prompt))
    write_card(cfg, out_dir, base, adapter, ranking)
    write_model_card(out_dir, cfg, base, adapter, run)


def _card_base(cfg: ModelConfig) -> str | None:
    # the cards name the start (a hub id, a package, a directory's name); peft loads it from its directory
    return None if cfg.random_init else base_model_name(cfg.path)


def rewrite_run_card(out_dir: Path, cfg: ModelConfig, run: RunRecord) -> None:
    """Rewrites README.md, the Hugging Face card of a model that save_reranker wrote, with figures that came after
    its weights (a run's final dev evaluation); the weights, tokenizer and lychee_reranker.json (which holds no
    figures) stay as they are. The card is replaced atomically."""
    write_model_card(out_dir, cfg, _card_base(cfg), (out_dir / ADAPTER_DIR).is_dir(), run)


log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def apply_levers(model: nn.Module, cfg: ModelConfig, precision: str, device: torch.device) -> nn.Module:
    """The LoRA dtype path, Liger kernels and compiled decoder layers, in place; returns the model."""
    if cfg.lora.enabled:
        lora_dtype(model, cfg.lora.dtype, precision)
    if cfg.liger_kernel:
        _liger(model, device)
    if cfg.compile_layers:
        for layer in decoder_layers(model):
            layer.compile()  # in place: parameter names (checkpoints, saving) stay as they are
    return model


def lora_dtype(model: nn.Module, mode: str, precision: str) -> None:
    adapters = [m for m in model.modules() if hasattr(m, "lora_A")]
    if mode == "model":
        dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
        for module in adapters:
            module.lora_A.to(dtype), module.lora_B.to(dtype)
    elif mode == "auto" and precision in ("bf16", "fp16"):
        # Under autocast the adapter matmuls run in bf16/fp16 whatever their input's dtype: peft's cast of each
        # input up to float32 (a copy per adapter, kept for the backward) buys nothing there.
        for module in adapters:
            module.cast_input_dtype_enabled = False


def _liger(model: nn.Module, device: torch.device) -> None:
    if device.type != "cuda":
        raise UserError("model.liger_kernel=true needs a CUDA device (Liger's kernels are Triton kernels)")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        raise UserError("model.liger_kernel=true needs the liger-kernel package (pip install liger-kernel)") from None
    base = model.backbone.get_base_model() if hasattr(model.backbone, "get_base_model") else model.backbone
    # the LM head's loss kernels are not used: the score reads the head's yes/no rows only (model.answer_head)
    _apply_liger_kernel_to_instance(model=base, cross_entropy=False, fused_linear_cross_entropy=False)
