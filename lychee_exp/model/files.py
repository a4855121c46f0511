"""Whether a model directory's files can be loaded, checked before transformers reads them.

transformers and safetensors answer a damaged directory with a traceback, often from inside a rank, after minutes
of work: a config.json that is not JSON, a model.safetensors cut short by a failed copy or a full disk, weights
that no longer fit a config.json whose sizes were changed, a directory saved without its tokenizer (AutoTokenizer
may still return one, and the prompt then breaks far from the cause) or with a tokenizer.json that is not one.
These checks read config.json, the tokenizer.json and each weights file's header (never the tensors; the
architecture config.json describes is built on the meta device, without memory) and say what is wrong in one
line, naming the key and the file. They are called where models are loaded (model.reranker, model.card's
check_trained_head, ir.dense), so that every command (run, mine, rerank, plan) gets the same line.

A saved model's files get the permissions of the user's umask (`match_umask`): safetensors writes 0600 whatever it.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

from lychee_exp.errors import UserError

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
