"""Read an offline W&B run back from its `run-<id>.wandb` file (LevelDB-log framing of protobuf records).

wandb ships no Python reader for this file in recent versions; the framing is small: a 7-byte header
(`:W&B`, magic, version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32c: 4 bytes,
length: 2 bytes little-endian, type: 1 byte: 1 full, 2 first, 3 middle, 4 last).
"""

import json
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: str | Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, buf = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer too short for a header: zero padding
            pos += BLOCK - pos % BLOCK
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            whole = chunk
        elif kind == 2:
            buf = chunk
            continue
        elif kind == 3:
            buf += chunk
            continue
        elif kind == 4:
            whole = buf + chunk
        else:
            continue
        rec = pb.Record()
        rec.ParseFromString(whole)
        yield rec


def history(path) -> list[dict]:
    """The logged history rows (one dict per `run.log` call)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return rows


def config(path) -> dict:
    out = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        items = rec.config.update if kind == "config" else rec.run.config.update if kind == "run" else []
        if items:
            for item in items:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
