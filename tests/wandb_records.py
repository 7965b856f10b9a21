"""Read back a W&B offline run file (`run-<id>.wandb`), for tests: wandb 0.31 has no public reader.

The file is a LevelDB-style log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each `crc32c (4) | length (2, little endian) | type (1: full, 2: first, 3: middle,
4: last)` followed by `length` bytes; a block's tail shorter than a chunk header is zero padding.
Joined chunks are serialized `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B run file"
    out, pending, pos = [], b"", HEADER.size
    while pos + CHUNK.size <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK.size:  # zero padding at the end of a block
            pos += room
            continue
        _, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        body = data[pos + CHUNK.size:pos + CHUNK.size + length]
        pos += CHUNK.size + length
        if kind in (FULL, FIRST):
            pending = body
        else:
            pending += body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def summary(path: Path) -> dict:
    """run id, name, project, group, tags, config (key -> value) and history rows (key -> value, with _step)."""
    info: dict = {"config": {}, "history": []}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            info.update(id=run.run_id, name=run.display_name, project=run.project, group=run.run_group,
                        tags=list(run.tags))
            for item in run.config.update:
                info["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                info["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            info["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                    for item in record.history.item})
    return info
