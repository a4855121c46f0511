"""Read an offline W&B run back from its `run-<id>.wandb` file, without network or W&B's service.

The file is a LevelDB-style log (W&B's datastore format): a 7-byte file header (":W&B", magic 0xBEE1,
version), then 32 KiB blocks of records, each with a 7-byte header (crc32c, length, type) and a chunk of a
protobuf `Record`; a record too long for its block is split FIRST / MIDDLE... / LAST across blocks.
Offline runs write no wandb-summary.json, so this is how tests (and users) check what a run recorded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # block tail too short for a header: zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # preallocated, unwritten space
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def read_run(path: Path) -> dict:
    """{'run': {id, group, job_type, tags}, 'config': {...}, 'summary': {...}, 'history': [{...}, ...]}."""
    out: dict = {"run": {}, "config": {}, "summary": {}, "history": []}
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {
                "id": record.run.run_id,
                "group": record.run.run_group,
                "job_type": record.run.job_type,
                "tags": list(record.run.tags),
                "name": record.run.display_name,
            }
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            out["summary"].update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "history":
            out["history"].append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return out


def find_run_files(root: Path) -> list[Path]:
    return sorted(Path(root).glob("**/wandb/*run-*/run-*.wandb"))
