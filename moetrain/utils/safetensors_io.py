"""Streaming safetensors: read one tensor (or a few rows of one) at a time, and write sharded
files tensor by tensor, so that a conversion holds a few tensors in memory, never the model.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
N bytes of JSON ``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, then the tensor bytes, offsets counted from the end of the header,
packed without gaps. Reading is a seek and a read into a fresh buffer: no pickle, no code from
the file, and no memory map (every touched page of a mapped file counts in the process's RSS
until it is unmapped, so a conversion that maps its input peaks at the size of the model).

A folder holds ``model.safetensors``, or shards named in ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``), as ``transformers`` writes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from moetrain.utils.files import atomic_write_text, fsync_dir

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the header size


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file and absolute byte range, dtype and shape."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """``(tensors, metadata)`` of one safetensors file, from its header alone; ValueError naming
    the file and entry when the header is malformed."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{str(path)!r} is not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{str(path)!r} is not a safetensors file (header is not JSON: {e})") from e
    base = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has dtype {entry.get('dtype')!r}, not one of "
                             f"{', '.join(DTYPES)}")
        shape = tuple(int(s) for s in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize or base + end > size:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has data_offsets {[begin, end]} that do not fit "
                             f"its shape {list(shape)} and dtype, or the file ({size} bytes)")
        tensors[name] = TensorInfo(path, dtype, shape, base + begin, base + end)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _read_bytes(info: TensorInfo, start: int, end: int) -> bytearray:
    buf = bytearray(end - start)
    with open(info.file, "rb") as f:
        f.seek(start)
        if f.readinto(buf) != len(buf):
            raise ValueError(f"{str(info.file)!r} ends before the tensor bytes at {start}..{end}")
    return buf


class SafetensorsFolder:
    """The tensors of a folder (``model.safetensors`` or an index and its shards), read lazily.

    ``get(name)`` reads one tensor; ``get_rows(name, start, stop)`` reads rows ``start:stop`` of
    its first dim (one expert of a stacked ``[E, ...]`` tensor) and nothing else.
    """

    def __init__(self, folder: str | os.PathLike, *, weights: str = WEIGHTS) -> None:
        self.folder = Path(folder)
        index = self.folder / weights.replace(".safetensors", ".safetensors.index.json")
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{str(index)!r} has no weight_map")
            files = sorted(set(weight_map.values()))
        elif (self.folder / weights).is_file():
            weight_map, files = None, [weights]
        else:
            raise ValueError(f"{str(self.folder)!r} has no {weights} or {index.name} (PyTorch .bin "
                             "checkpoints are not read: they unpickle code; re-save with safetensors)")
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for name in files:
            if Path(name).name != name or not (self.folder / name).is_file():
                raise ValueError(f"{str(self.folder)!r}: shard {name!r} named in the index is missing")
            tensors, metadata = read_header(self.folder / name)
            self.metadata = self.metadata or metadata
            self.tensors.update(tensors)
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.tensors))
            if missing:
                raise ValueError(f"{str(index)!r} names tensors its shards lack: {', '.join(missing[:8])}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{str(self.folder)!r} holds no tensor {name!r}")
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor:
        info = self.info(name)
        return _tensor(_read_bytes(info, info.start, info.end), info.dtype, info.shape)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self.info(name)
        assert info.shape and 0 <= start <= stop <= info.shape[0], (name, info.shape, start, stop)
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        buf = _read_bytes(info, info.start + start * row_bytes, info.start + stop * row_bytes)
        return _tensor(buf, info.dtype, (stop - start, *info.shape[1:]))


def _tensor(buf: bytearray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(tuple(shape))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: known before its values are (the header comes first)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Consecutive tensors per shard, each shard at most ``max_shard_bytes`` unless a single
    tensor is larger (it then gets a shard of its own, as ``transformers`` does)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if max_shard_bytes is not None and shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header_bytes(specs: Iterable[TensorSpec], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


class ShardedWriter:
    """Write ``specs`` into ``folder`` tensor by tensor, in spec order, as ``weights`` or as
    shards of at most ``max_shard_bytes`` with an index. Each shard's header is written first
    (every name, shape and dtype is known up front), then each tensor's bytes as ``write`` gets
    them: memory holds one tensor. The files appear under their names only once all are
    complete (``close``); the index is renamed into place last. Use as a context manager: an
    exception removes the partial files. ``durable`` (checkpoints, exports) also fsyncs every
    file and the folder, so that what was renamed into place survives a power loss."""

    def __init__(self, folder: str | os.PathLike, specs: Sequence[TensorSpec], *, metadata: dict[str, str],
                 max_shard_bytes: int | None = None, weights: str = WEIGHTS, durable: bool = True) -> None:
        names = [s.name for s in specs]
        assert len(set(names)) == len(names), "duplicate tensor names"
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self.shards = plan_shards(specs, max_shard_bytes)
        num = len(self.shards)
        stem = weights.removesuffix(".safetensors")
        self.files = [weights] if num == 1 else [f"{stem}-{i + 1:05d}-of-{num:05d}.safetensors" for i in range(num)]
        self.index_name = weights.replace(".safetensors", ".safetensors.index.json")
        self.metadata = dict(metadata)
        self._order = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._tmp = [self.folder / f".{f}.tmp-{os.getpid()}" for f in self.files]
        self._handle: BinaryIO | None = None
        self._shard = -1

    def __enter__(self) -> ShardedWriter:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if exc_type is not None:
            for tmp in self._tmp:
                tmp.unlink(missing_ok=True)

    @property
    def next_name(self) -> str | None:
        return self._order[self._next][1].name if self._next < len(self._order) else None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard, spec = self._order[self._next]
        assert name == spec.name, f"tensors must come in spec order: got {name!r}, expected {spec.name!r}"
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"tensor {name!r}: {tuple(tensor.shape)} {tensor.dtype} does not match its "
                             f"planned {spec.shape} {spec.dtype}")
        if shard != self._shard:
            if self._handle is not None:
                self._finish_file()
            self._shard = shard
            # Open across write() calls (one shard spans many); closed by _finish_file or __exit__.
            self._handle = open(self._tmp[shard], "wb")  # noqa: SIM115
            self._handle.write(_header_bytes(self.shards[shard], self.metadata))
        assert self._handle is not None, "the shard of every tensor was opened above"
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._handle.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def _finish_file(self) -> None:
        assert self._handle is not None, "called with a shard open"
        self._handle.flush()
        if self.durable:
            os.fsync(self._handle.fileno())
        self._handle.close()
        self._handle = None

    def close(self) -> list[Path]:
        """Finish the last shard, rename every file into place and write the index; returns
        the paths written."""
        assert self._next == len(self._order), f"{len(self._order) - self._next} tensors were never written"
        if self._handle is not None:
            self._finish_file()
        for tmp, shard in zip(self._tmp, self.shards, strict=True):
            if not tmp.exists():  # a shard of no tensors (an empty model): its header alone
                tmp.write_bytes(_header_bytes(shard, self.metadata))
        umask = os.umask(0)
        os.umask(umask)
        out = []
        for tmp, name in zip(self._tmp, self.files, strict=True):
            os.chmod(tmp, 0o666 & ~umask)  # exports are for sharing
            os.replace(tmp, self.folder / name)
            out.append(self.folder / name)
        stale_index = self.folder / self.index_name
        if len(self.files) > 1:
            weight_map = {spec.name: self.files[i] for i, spec in self._order}
            total = sum(spec.nbytes for _, spec in self._order)
            text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
            atomic_write_text(stale_index, text, durable=self.durable)
            out.append(stale_index)
        elif stale_index.exists():
            stale_index.unlink()  # a sharded output written here before would shadow the single file
        if self.durable:
            fsync_dir(self.folder)
        return out


def parse_size(text: str | int | None) -> int | None:
    """``"5GB"``, ``"500MiB"``, ``"1e9"`` or an int of bytes -> bytes; None stays None."""
    if text is None or isinstance(text, int):
        return text
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "tib": 2**40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise ValueError(f"--max-shard-size ({text!r}) must be a positive size such as 5GB, 500MiB or 1000000")
    return int(value * units[unit])
