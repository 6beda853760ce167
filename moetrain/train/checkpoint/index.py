"""The DCP index of a checkpoint as JSON, and the reader that uses it: loading a checkpoint never
unpickles anything. Also reading single entries (``saved_like``, ``json_entry``) and the one-process
``load_model_weights``.

DCP indexes its files with ``.metadata``, a Python pickle that ``FileSystemReader`` loads with
``pickle.load``, and it stores every non-tensor entry as a pickle that its load planner reads with
``torch.load(weights_only=False)`` (torch 2.13): a crafted checkpoint would run code in either
place. So moetrain checkpoints hold tensors only (JSON text goes in uint8 tensors), the index is
also written as ``index.json``, and ``SafeReader`` reads that instead of ``.metadata``. An index
entry that is not a tensor is refused before DCP reads anything; tensor data is read by DCP with
``torch.load(weights_only=True)``. ``.metadata`` is still written, so that DCP's own tools can
read the folder, but moetrain never opens it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from moetrain.train.checkpoint.files import CheckpointError, read_manifest, require_file_name, verify_local

INDEX = "index.json"
INDEX_FORMAT = "moetrain-dcp-index/1"
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def text_tensor(text: str) -> torch.Tensor:
    """``text`` as a uint8 tensor of its UTF-8 bytes (how JSON entries are stored)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def tensor_text(t: torch.Tensor) -> str:
    return bytes(t.numpy()).decode("utf-8")


def index_to_json(metadata: Metadata) -> dict[str, Any]:
    """The parts of DCP's ``Metadata`` that loading needs, as JSON. Raises ``TypeError`` for an
    entry that is not a tensor (moetrain stores none)."""
    entries = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"checkpoint entry {fqn!r} is a {type(md).__name__}: moetrain checkpoints "
                             "hold tensors only, since DCP unpickles every other entry when loading")
        p = md.properties
        if p.layout != torch.strided or p.memory_format != torch.contiguous_format:
            raise ValueError(f"checkpoint entry {fqn!r} has layout {p.layout} and memory format "
                             f"{p.memory_format}: only strided, contiguous tensors are stored")
        entries[fqn] = {"kind": "tensor", "dtype": str(p.dtype).removeprefix("torch."),
                        "requires_grad": p.requires_grad, "pin_memory": p.pin_memory,
                        "size": list(md.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
    storage = [[index.fqn, None if index.offset is None else list(index.offset), index.index,
                info.relative_path, info.offset, info.length,
                None if info.transform_descriptors is None else list(info.transform_descriptors)]
               for index, info in metadata.storage_data.items()]
    planner = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
    return {"format": INDEX_FORMAT, "version": metadata.version, "entries": entries, "storage": storage,
            "planner_data": planner}


def _tensor_entry(fqn: str, e: dict) -> TensorStorageMetadata:
    if not isinstance(e, dict) or e.get("kind") != "tensor":
        kind = e.get("kind") if isinstance(e, dict) else type(e).__name__
        raise CheckpointError(
            f"entry {fqn!r} is stored as {kind!r}, not as a tensor: DCP would unpickle it, which can run "
            "code from the file, so the checkpoint is refused")
    dtype = _DTYPES.get(e["dtype"])
    if dtype is None:
        raise CheckpointError(f"entry {fqn!r} has unknown dtype {e['dtype']!r}")
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in e["chunks"]]
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype, requires_grad=bool(e["requires_grad"]),
                                    pin_memory=bool(e["pin_memory"])),
        size=torch.Size(e["size"]), chunks=chunks)


def _storage_item(row: list) -> tuple[MetadataIndex, _StorageInfo]:
    fqn, offset, index, relative_path, file_offset, length, transforms = row
    relative_path = require_file_name(relative_path, named_by=f"entry {fqn!r}")  # DCP opens path / relative_path
    info = _StorageInfo(relative_path=relative_path, offset=int(file_offset), length=int(length),
                        transform_descriptors=None if transforms is None else [str(t) for t in transforms])
    return MetadataIndex(fqn=str(fqn), offset=offset, index=index), info


def read_index(path: Path, *, load_id: str | None = None) -> Metadata:
    """DCP ``Metadata`` of checkpoint ``path`` from its JSON index (``load_id``: the reader's).
    Raises ``CheckpointError`` when the index is missing, malformed or names an entry that is not a
    tensor."""
    file = path / INDEX
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {INDEX}; its only index would be DCP's "
                              "pickled .metadata, which moetrain does not load (it could run code)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        if data.get("format") != INDEX_FORMAT:
            raise CheckpointError(f"{INDEX} has format {data.get('format')!r}, expected {INDEX_FORMAT}")
        entries: dict[str, STORAGE_TYPES] = {fqn: _tensor_entry(fqn, e) for fqn, e in data["entries"].items()}
        storage = dict(_storage_item(row) for row in data["storage"])
        planner = {k: tuple(v) for k, v in data["planner_data"].items()}
        version = data["version"]
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from e
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {INDEX} is malformed "
                              f"({type(e).__name__}: {e})") from e
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(load_id=load_id), version=version)


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` that takes the index from ``index.json`` instead of unpickling
    ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_index(Path(self.path), load_id=self.load_id)


def saved_like(metadata: Metadata, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh tensor shaped like saved entry ``key`` (empty when there is none: the check against
    the index then reports it missing)."""
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        return torch.empty(0, dtype=dtype or torch.uint8)
    return torch.empty(md.size, dtype=dtype or md.properties.dtype)


def json_entry(path: Path, state: dict, key: str) -> Any:
    """The JSON value stored as text in the (dotted) entry ``key`` of a loaded ``state``."""
    t: Any = state
    for part in key.split("."):
        t = t[part]
    try:
        return json.loads(tensor_text(t))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError alike
        raise CheckpointError(f"checkpoint {str(path)!r}: entry {key} is not JSON text ({e})") from e


def load_model_weights(path: str | os.PathLike, *,
                       verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Full (consolidated) model tensors of checkpoint ``path`` in one process, without building the
    model or a process group, plus its trainer state (which holds the resolved config). The raw
    ``model.`` entries: a weight average (``ema.``) is read by ``moetrain.interop.sources``."""
    path = Path(path)
    # Local checks only: this runs in one process, even where a process group happens to exist.
    verify_local(path) if verify else read_manifest(path)
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    if "trainer" not in metadata.state_dict_metadata:
        raise CheckpointError(f"checkpoint {str(path)!r} has no trainer entry")
    tensors = {key[len("model."):]: saved_like(metadata, key) for key in metadata.state_dict_metadata
               if key.startswith("model.")}
    state: dict[str, Any] = {"model": tensors, "trainer": saved_like(metadata, "trainer", torch.uint8)}
    _load_in_this_process(path, reader, state)
    return state["model"], json_entry(path, state, "trainer")


def read_trainer_state(path: str | os.PathLike) -> Any:
    """The JSON ``trainer`` entry of checkpoint ``path`` (step, schedule, data position, the resolved
    config), read alone in this process: a small read, before the collective load of the tensors."""
    path = Path(path)
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    if "trainer" not in metadata.state_dict_metadata:
        raise CheckpointError(f"checkpoint {str(path)!r} has no trainer entry")
    state: dict[str, Any] = {"trainer": saved_like(metadata, "trainer", torch.uint8)}
    _load_in_this_process(path, reader, state)
    return json_entry(path, state, "trainer")


def _load_in_this_process(path: Path, reader: SafeReader, state: dict[str, Any]) -> None:
    """``dcp.load`` of ``state`` from ``path`` without a process group; any failure a CheckpointError."""
    try:
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming ... a single process": intended.
            warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"reading checkpoint {str(path)!r} failed: {type(e).__name__}: {e}") from e
