"""A model directory: its card (what it is and the config a command runs with it) and whether its files load.

`save_reranker` writes `lychee_reranker.json` (the card) beside the weights: what the directory is (model.kind, the
score: yes/no tokens or a classifier logit, text pairs), the prompt it was trained with, the preset that trained
it and the run's other model keys. `resolve_model` reads it, so `rerank`, `mine teacher=reranker` and training
from `model.path=` need no preset:

- the user's `model.path` holds a card and no `model=<preset>` was given: the card's description wins over the
  command's default preset; keys given as `model.<key>=` still apply on top;
- an explicit `model=<preset>` that contradicts the card (kind, score, text pairs, prompt) is one line;
- a directory without a card (a model from elsewhere) is read by its config.json `architectures`:
  `*ForSequenceClassification` is a cross-encoder fed text pairs, `*ForCausalLM` a yes/no causal LM, unless a
  preset was given; a sequence classifier under a causal-LM preset is one line;
- a preset's `random_init` applies only when the user gave no `model.path`: an explicit one means its weights
  (`model.random_init=true` asks for random ones), and a directory without any is one line before training;
- `rerank` and `mine` never take a preset's `random_init` (conf/rerank.yaml, conf/mine.yaml): scoring with an
  untrained model is one line unless `model.random_init=true` asks for it.

`check_trained_head` (before any process starts) and `new_head_allowed` (load_reranker's loading report) keep a
freshly initialised head from ever scoring: only training from a base model that is not a reranker of the kind
asked for (no card, other architectures) may start one.

Whether the files can be loaded, checked before transformers reads them: transformers and safetensors answer a damaged
directory with a traceback, often from inside a rank, after minutes of work: a config.json that is not JSON, a
model.safetensors cut short by a failed copy or a full disk, weights that no longer fit a config.json whose sizes were
changed, a directory saved without its tokenizer (AutoTokenizer may still return one, and the prompt then breaks far
from the cause) or with a tokenizer.json that is not one. These checks read config.json, the tokenizer.json and each
weights file's header (never the tensors; the architecture config.json describes is built on the meta device, without
memory) and say what is wrong in one line, naming the key and the file. They are called where models are loaded
(model.reranker, this module's check_trained_head, ir.dense), so that every command (run, mine, rerank, plan) gets the
same line.

A saved model's files get the permissions of the user's umask (`match_umask`): safetensors writes 0600 whatever it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lychee_exp.config.schema import LoraConfig, ModelConfig, PromptConfig
from lychee_exp.errors import UserError
from lychee_exp.io.user_files import resolve_path

# one of these holds the vocabulary a transformers tokenizer is built from (tokenizer_config.json alone does not)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
HEADER_LIMIT = 100_000_000  # safetensors' own bound on a header's length


def check_config_json(path: Path, where: str) -> dict:
    """path/config.json as a JSON object; `where`: the key and value that named the directory."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # a UnicodeDecodeError is a ValueError too
        raise UserError(f"{where}: {file} is not readable JSON ({_first_line(err)})") from None
    if not isinstance(config, dict):
        raise UserError(f"{where}: {file} is not a JSON object (a transformers config)")
    return config


def check_weights(path: Path, where: str) -> None:
    """Every weights file in path is whole: a safetensors file as long as its header says, a torch zip archive
    with its central directory (what a cut-short copy loses first)."""
    for index in sorted(path.glob("*.index.json")):  # a sharded model: every shard its index names
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{where}: {index} is not a weights index ({_first_line(err)})") from None
        missing = sorted(name for name in shards if not (path / name).is_file())
        if missing:
            raise UserError(f"{where}: {index} names {len(missing)} missing shard(s) ({', '.join(missing[:3])})")
    headers = {}
    for file in sorted(path.glob("*.safetensors")):
        problem, headers[file] = _safetensors_header(file)
        if problem is not None:
            raise UserError(f"{where}: {file} {problem}; copy or save the model again")
    for file in sorted(path.glob("*.bin")):
        with file.open("rb") as handle:
            zipped = handle.read(2) == b"PK"  # torch.save's archive; older pickles are not checked
        if zipped and not zipfile.is_zipfile(file):
            raise UserError(f"{where}: {file} is truncated (a torch archive without its end); copy or save it again")
    if headers and (path / "config.json").is_file():
        _check_fits_config(path, headers, where)


def _check_fits_config(path: Path, headers: dict[Path, dict], where: str) -> None:
    """Each tensor of the safetensors headers has the shape the architecture in config.json gives it (a changed
    hidden_size, or another model's config.json: transformers refuses the size mismatch deep inside loading).
    Tensors the base architecture does not name (a head, renamed legacy keys) are left to loading."""
    import torch
    import transformers

    config_file = path / "config.json"
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{where}: {config_file} is not a transformers config ({_first_line(err)})") from None
    if getattr(config, "quantization_config", None):  # quantized tensors are packed: their shapes differ by design
        return
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        base = transformers.AutoModel.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in base.state_dict().items()}
    prefix = f"{base.base_model_prefix}."
    for file, header in headers.items():
        for name, entry in header.items():
            wanted = expected.get(name.removeprefix(prefix)) if isinstance(entry, dict) else None
            found = tuple(entry.get("shape", ())) if wanted is not None else None
            if wanted is not None and found != wanted:
                keys = _config_keys(config, set(wanted) - set(found))
                raise UserError(
                    f"{where}: {file} does not fit {config_file} ({name} is {list(found)} in the weights, "
                    f"{list(wanted)} by config.json{keys}): the config was changed or belongs to another model"
                )


def _config_keys(config, sizes: set[int]) -> str:
    """`: hidden_size=96`, the config.json keys whose values give the sizes the weights do not have."""
    keys = [f"{k}={v}" for k, v in config.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)]
    named = [key for key in keys if int(key.partition("=")[2]) in sizes]
    return f"'s {', '.join(named[:3])}" if named else ""


def check_tokenizer_files(path: Path, where: str) -> None:
    """A tokenizer's vocabulary is there, and a tokenizer.json is one (read by the tokenizers library that
    transformers builds it with: `{}` is JSON, but transformers fails on it with a KeyError)."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise UserError(
            f"{where}: {path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer "
            "beside the model (tokenizer.save_pretrained(<dir>))"
        )
    file = path / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(file))
        except Exception as err:  # the Rust parser's errors are plain Exceptions: "Model missing. at line 1 ..."
            raise UserError(f"{where}: {file} is not a tokenizer ({_first_line(err)})") from None


def match_umask(directory: Path) -> None:
    """Gives every file under directory the mode the user's umask gives a new file (safetensors and torch's
    writers create theirs 0600, which another user of a shared model directory then cannot read)."""
    mode = 0o666 & ~_umask()
    for root, _, files in os.walk(directory):
        for name in files:
            os.chmod(os.path.join(root, name), mode)


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it: another thread could create a file
    meanwhile); /proc has it since Linux 4.7."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _safetensors_header(file: Path) -> tuple[str | None, dict]:
    """What is wrong with a safetensors file (8 bytes of header length, the JSON header, then the data), or None;
    and its header (the tensors' names, dtypes, shapes and offsets)."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        start = handle.read(8)
        if len(start) < 8:
            return f"is truncated ({size} bytes, shorter than a safetensors header)", {}
        length = int.from_bytes(start, "little")
        if length > HEADER_LIMIT:
            return "is not a safetensors file (its header length is implausible)", {}
        if 8 + length > size:
            return f"is truncated ({size:,} bytes, its header alone takes {8 + length:,})", {}
        try:
            header = json.loads(handle.read(length))
            end = max(
                (int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "is not a safetensors file (its header is not a tensor index)", {}
    if size < 8 + length + end:
        return f"is truncated ({size:,} of {8 + length + end:,} bytes)", header
    return None, header


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


CARD_FILE = "lychee_reranker.json"
FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)  # cards this version reads; a later format may mean the same keys differently
ADAPTER_DIR = "adapter"  # a LoRA run's peft adapter, beside the merged model
# what a card describes; the rest belongs to the command that loads it (path, random_init) or to the machine
# that trained it (kernels and attention implementations another machine may lack)
_NOT_DESCRIBED = ("name", "path", "random_init", "attn_implementation", "compile_layers", "liger_kernel")
_DESCRIBED = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _NOT_DESCRIBED]
# a bare encoder (BertModel: all-MiniLM-L6-v2 as shipped) has no head: it ranks as the bi-encoder it was trained as
_ARCHITECTURE_KINDS = {
    "ForSequenceClassification": "sequence_classification",
    "ForCausalLM": "causal_lm",
    "Model": "bi_encoder",
}
# a cross-encoder from elsewhere: its own tokenizer's maximum, the pair as its authors feed it
_PAIR_PROMPT = {"text_pair": True, "query_template": "{query}", "max_len": 0}


@dataclass(frozen=True)
class ModelChoice:
    """What the command line said about the model: `model=<preset>` and the `model.<key>=` keys (dotted)."""

    preset: str | None = None
    keys: tuple[str, ...] = ()

    def gave(self, key: str) -> bool:
        """Whether `key` (or a node above or below it) was given explicitly."""
        return any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in self.keys)


def model_choice(overrides: Sequence[str], preset: str | None = None) -> ModelChoice:
    """The model part of Hydra command-line overrides; `preset`: a model group choice made elsewhere (an
    experiment's), counted as given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if key == "model" and not override.is_delete():
            preset = str(override.value())
        elif key.startswith("model."):
            keys.append(key[len("model.") :])
    return ModelChoice(preset, tuple(keys))


def write_card(cfg: ModelConfig, out_dir: Path, base: str | None, adapter: bool, ranking: dict | None = None) -> None:
    described = dataclasses.asdict(cfg)
    card = {
        "format_version": FORMAT_VERSION,
        "preset": cfg.name,
        "kind": str(cfg.kind),
        # how a score is read: the classifier's one logit, or the yes/no tokens' logits (model.score)
        "head": {"causal_lm": "yes_no_tokens", "bi_encoder": "cosine"}.get(str(cfg.kind), "logit"),
        "score": str(cfg.score),
        "text_pair": cfg.kind != "causal_lm" and cfg.prompt.text_pair,
        "prompt": described["prompt"],
        "settings": {k: described[k] for k in _DESCRIBED if k not in ("kind", "score", "prompt")},
        "base_model": base,  # the weights training started from (None: random initialisation)
        "adapter": ADAPTER_DIR if adapter else None,
        # the dev ranking the run was tuned on: {"teacher_weight", "teacher": the bi-encoder's settings}; rerank's
        # teacher_weight=null follows it (ir.fusion)
        "ranking": ranking or {"teacher_weight": 0.0},
    }
    (out_dir / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")  # choices are str: their values


def read_card(path: Path) -> dict | None:
    """The card of a model directory, or None (a model from elsewhere); an unreadable one is one line."""
    file = path / CARD_FILE
    if not file.is_file():
        return None
    try:
        card = json.loads(file.read_text())
        if not isinstance(card, dict) or "kind" not in card:
            raise ValueError("no kind")
    except ValueError as err:
        raise UserError(f"model.path: {file} is not a model card ({err})") from None
    version = card.get("format_version")
    if version is None:  # written before text pairs: one templated string
        card.setdefault("prompt", {}).setdefault("text_pair", False)
    elif version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise UserError(
            f"model.path: {file} has format_version={version!r}; this lychee_exp reads format_version {readable} "
            "(and cards without one): read it with the lychee_exp that wrote it"
        )
    return card


def card_ranking(path: str) -> dict:
    """The ranking recipe a model directory's card records ({"teacher_weight": 0.0} without one)."""
    card = read_card(resolve_path(path, "model.path")) or {}
    return card.get("ranking") or {"teacher_weight": 0.0}


def card_model(card: dict) -> dict:
    """The model keys a card describes (a ModelConfig's fields but path and random_init)."""
    settings = {k: v for k, v in card.get("settings", {}).items() if k in _DESCRIBED}
    model = {**settings, "kind": card["kind"], "prompt": _known(card.get("prompt", {}), PromptConfig)}
    model["name"] = card.get("preset") or "model_card"
    if "score" in card:
        model["score"] = card["score"]
    if "lora" in model:
        model["lora"] = _known(model["lora"], LoraConfig)
    return model


def _known(values: dict, schema: type) -> dict:
    """The keys this version's schema has (a card from a later version may hold more)."""
    names = {f.name for f in dataclasses.fields(schema)}
    return {k: v for k, v in values.items() if k in names}


def architecture_kind(path: Path) -> tuple[str | None, list[str]]:
    """(the model.kind its config.json's architectures name, or None; the architectures)."""
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None, []
    kinds = {kind for arch in architectures for end, kind in _ARCHITECTURE_KINDS.items() if arch.endswith(end)}
    return (kinds.pop() if len(kinds) == 1 else None), architectures


def has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin"))


def _directory(spec: str) -> Path | None:
    try:
        path = resolve_path(spec, "model.path")
    except UserError:
        return None  # model_dir says what is wrong, with the command's other checks
    return path if (path / "config.json").is_file() else None


def _identity(model: dict) -> dict[str, object]:
    """The keys that decide how a directory's weights read a pair: a contradiction in any changes the scores."""
    prompt = model.get("prompt", {})
    keys: dict[str, object] = {"kind": str(model.get("kind"))}
    if keys["kind"] == "causal_lm":
        keys["score"] = str(model.get("score", "yes_minus_no"))
        for name in ("prefix", "separator", "template", "suffix", "answer_prefix", "chat_template", "yes_token"):
            keys[f"prompt.{name}"] = prompt.get(name)
        if keys["score"] == "yes_minus_no":
            keys["prompt.no_token"] = prompt.get("no_token")
    else:
        keys["prompt.text_pair"] = bool(prompt.get("text_pair", True))
        keys["prompt.query_template" if keys["prompt.text_pair"] else "prompt.template"] = prompt.get(
            "query_template" if keys["prompt.text_pair"] else "template"
        )
    return keys


def _check_agrees(composed: dict, card: dict, given: ModelChoice, file: Path) -> None:
    """An explicit preset must describe the directory as its card does (keys the user set by hand excepted);
    an explicit model.kind must in any case: weights read as another kind score nothing."""
    ours, theirs = _identity(composed), _identity(card_model(card))
    for key, value in theirs.items():
        by = f"model.{key}" if given.gave(key) else f"model={given.preset}" if given.preset else None
        if by is None or (given.gave(key) and key != "kind") or ours.get(key) == value:
            continue
        raise UserError(
            f"{by} contradicts model.path: {file} says {key}={value!r} (preset {card.get('preset')}), the "
            f"command {key}={ours.get(key)!r}; leave out {by} to use the directory's own description"
        )


def _set(model: dict, key: str, value: object) -> None:
    *parents, last = key.split(".")
    node = model
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = copy.deepcopy(value)


def _get(model: dict, key: str) -> object:
    node: object = model
    for part in key.split("."):
        node = node[part]  # type: ignore[index]
    return node


def resolve_model(composed: dict, given: ModelChoice) -> dict:
    """The model keys a command runs with, from the composed ones (a plain, resolved `model` node) and what the
    user gave explicitly. Unchanged without an explicit model.path (a preset's own directory)."""
    if not given.gave("path"):
        return composed
    path = _directory(str(composed["path"]))
    if path is None:
        return composed
    card = read_card(path)
    resolved = composed = copy.deepcopy(composed)
    if card is not None:
        _check_agrees(composed, card, given, path / CARD_FILE)
        if given.preset is None:
            resolved = card_model(card)
    else:
        kind, architectures = architecture_kind(path)
        if kind == "sequence_classification" and composed["kind"] == "causal_lm" and not given.gave("kind"):
            by = f"model={given.preset}" if given.preset else "model.kind"
            raise UserError(
                f"{by} (causal_lm) contradicts model.path={composed['path']}: its config.json holds a sequence "
                f"classifier ({', '.join(architectures)}); leave out model= to read it as a cross-encoder"
            )
        if given.preset is None and kind is not None:
            resolved = {"name": path.name, "kind": kind, "prompt": dict(_PAIR_PROMPT) if kind != "causal_lm" else {}}
    if resolved is not composed:
        for key in given.keys:
            try:
                _set(resolved, key, _get(composed, key))
            except (KeyError, TypeError):
                continue  # a key the schema refuses: composing has said so already
    resolved["path"] = composed["path"]
    if not given.gave("random_init"):
        resolved["random_init"] = False  # model.path means its weights: random ones only when asked for
    return resolved


def check_trained_head(cfg: ModelConfig) -> None:
    """Before scoring (rerank, mine's teacher): the directory must hold a trained head of cfg.kind, as its card
    or its architectures say, in whole weights files; else the head would be freshly initialised, or the ranks
    would fail on the file. random_init scores a random model: never under the name of a directory of weights,
    and without weights only when asked for (model.random_init=true: a preset's does not apply to scoring)."""
    path = _directory(cfg.path)
    if path is None:
        return
    if cfg.random_init:
        if has_weights(path):
            raise UserError(
                f"model.random_init=true with model.path={cfg.path}, which holds trained weights: it would score a "
                "random model under that directory's name; leave out model.random_init to score its weights"
            )
        return
    if not has_weights(path):
        raise UserError(
            f"model.path={cfg.path} holds no weights ({cfg.name} is untrained): it would score with random weights; "
            "give a trained model with model.path=<run>/model (a training run's saved model), or set "
            "model.random_init=true to score an untrained model on purpose"
        )
    card = read_card(path)
    kind, architectures = architecture_kind(path)
    described = card["kind"] if card else kind
    if described != cfg.kind:
        what = f"its {CARD_FILE} says kind={card['kind']}" if card else f"its architectures are {architectures}"
        hint = " (or leave out model= to read it as it is)" if described else ""
        raise UserError(
            f"model.path={cfg.path}: {what}, so as model.kind={cfg.kind} its scoring head would be freshly "
            f"initialised; give a trained reranker's model/ directory{hint}"
        )
    check_weights(path, f"model.path={cfg.path}")


def new_head_allowed(cfg: ModelConfig, training: bool) -> bool:
    """Whether loading may initialise weights the directory lacks: only when training starts from a base model
    that is not a reranker of this kind (no card, and its architectures name another kind)."""
    path = _directory(cfg.path)
    if not training or path is None or read_card(path) is not None:
        return False
    return architecture_kind(path)[0] != cfg.kind
