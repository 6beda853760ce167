"""Reads back what a W&B run wrote offline (``run-<id>.wandb``), without wandb's reader, which its
Python package no longer ships: the file is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of
records, each a 7-byte header of CRC32, length and chunk type) of ``wandb_internal_pb2.Record`` messages."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pos += HEADER
        if kind == 0 and length == 0:
            continue
        pending += data[pos:pos + length]
        pos += length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: Path) -> dict[int, dict]:
    """Each logged step's row: key -> value (nested keys joined by "/")."""
    rows: dict[int, dict] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows[int(row["_step"])] = row
    return rows


def run_file(run_dir: Path, timeout_s: float = 60.0) -> Path:
    """The offline run file under ``run_dir``, once it ends with the run's exit record: ``run.finish()``
    can return while wandb's service process is still writing the file."""
    (found,) = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    while not _has_exit(found):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{found} has no exit record after {timeout_s} s")
        time.sleep(0.2)
    return found


def _has_exit(path: Path) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))
    except Exception:  # a record cut short: the writer is still at it
        return False
