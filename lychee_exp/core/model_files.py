"""Whether a model directory's files can be loaded, checked before transformers reads them.

transformers and safetensors answer a damaged directory with a traceback, often from inside a rank, after minutes
of work: a config.json that is not JSON, a model.safetensors cut short by a failed copy or a full disk, a directory
saved without its tokenizer (AutoTokenizer may still return one, and the prompt then breaks far from the cause).
These checks read a few kilobytes (config.json, each weights file's header) and say what is wrong in one line,
naming the key and the file. They are called where models are loaded (core.model, core.model_card's
check_trained_head, core.ir.dense), so that every command (run, mine, rerank, plan) gets the same line.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from lychee_exp.core.errors import UserError

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
    for file in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem is not None:
            raise UserError(f"{where}: {file} {problem}; copy or save the model again")
    for file in sorted(path.glob("*.bin")):
        with file.open("rb") as handle:
            zipped = handle.read(2) == b"PK"  # torch.save's archive; older pickles are not checked
        if zipped and not zipfile.is_zipfile(file):
            raise UserError(f"{where}: {file} is truncated (a torch archive without its end); copy or save it again")


def check_tokenizer_files(path: Path, where: str) -> None:
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return
    raise UserError(
        f"{where}: {path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer "
        "beside the model (tokenizer.save_pretrained(<dir>))"
    )


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file (8 bytes of header length, the JSON header, then the data), or None."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        start = handle.read(8)
        if len(start) < 8:
            return f"is truncated ({size} bytes, shorter than a safetensors header)"
        length = int.from_bytes(start, "little")
        if length > HEADER_LIMIT:
            return "is not a safetensors file (its header length is implausible)"
        if 8 + length > size:
            return f"is truncated ({size:,} bytes, its header alone takes {8 + length:,})"
        try:
            header = json.loads(handle.read(length))
            end = max(
                (int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "is not a safetensors file (its header is not a tensor index)"
    if size < 8 + length + end:
        return f"is truncated ({size:,} of {8 + length + end:,} bytes)"
    return None


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
