"""Token files: the whole corpus tokenised once, stored flat and memory-mapped at startup.

Format (also what a user supplies as pre-tokenised data, `data.corpus=path data.path=FILE.bin`):

- ``NAME.bin``: the token ids back to back, no header, little-endian unsigned integers of
  ``uint16`` when vocab_size <= 65536, else ``uint32`` (`token_dtype`). Writing one from numpy:
  ``np.asarray(ids, dtype="<u2").tofile("NAME.bin")``.
- ``NAME.bin.json`` (the sidecar, required): ``{"dtype": "uint16", "vocab_size": 50257}`` and,
  optionally, ``"num_tokens"`` (checked against the file size), ``"eos_id"`` (the end-of-text id
  after each document: what ``data.document_mask`` needs) and ``"tokenizer"`` (the key of the
  tokeniser that wrote it: checked against the other sources of a mixture).

A data source may hold many such files (shards, read in path order); ``write_token_shards`` writes
them from documents, cut between documents, every document followed by the end-of-text id, and
``moetrain data prepare`` from jsonl/parquet/arrow corpora (moetrain.data.prepare_corpus).
A ``NAME.bin`` with a ``NAME.idx`` beside it is Megatron-LM's indexed dataset instead
(moetrain.data.megatron), read by the same `open_token_file`.

Ids in a user's file are not range-checked when it is opened (that would read the whole file); the
embedding lookup fails on an id >= vocab_size.

A sidecar rather than a header keeps the .bin a plain array that ``np.memmap`` (or ``np.fromfile``)
reads with no offset, and lets nanoGPT-style files be used by adding one small json next to them.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from moetrain.data.cache import resolve_cache_dir
from moetrain.data.megatron import is_megatron, open_megatron
from moetrain.utils.files import atomic_path, atomic_write_text

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

# Texts encoded per `encode_batch` call: big enough for the Rust side to use every core, small enough
# that a multi-GB corpus is never held in memory at once.
_ENCODE_BATCH_CHARS = 8 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return TOKEN_DTYPES["uint16"] if vocab_size <= 1 << 16 else TOKEN_DTYPES["uint32"]


def sidecar_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def write_token_file(path: str | os.PathLike, ids: Iterable, *, vocab_size: int, **meta) -> int:
    """Write ``ids`` (an iterable of int sequences/arrays, written in order) and the sidecar.

    Both files are written atomically, the sidecar last: a token file without a matching sidecar is
    never trusted. Returns the number of tokens.
    """
    dtype = token_dtype(vocab_size)
    num_tokens = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for chunk in ids:
            array = np.asarray(chunk, dtype=np.int64)
            if array.size and (array.min() < 0 or array.max() >= vocab_size):
                raise ValueError(f"token ids must be in [0, {vocab_size}), "
                                 f"got [{array.min()}, {array.max()}]")
            array.astype(dtype).tofile(f)
            num_tokens += array.size
    sidecar = {"dtype": dtype.name, "vocab_size": vocab_size, "num_tokens": num_tokens, **meta}
    atomic_write_text(sidecar_path(path), json.dumps(sidecar, indent=1) + "\n")
    return num_tokens


def open_token_file(path: str | os.PathLike) -> tuple[np.ndarray, dict]:
    """Memory-map a token file read-only; returns (tokens [N], sidecar dict). Reads no token data.

    A .bin with an .idx beside it is Megatron-LM's indexed dataset (moetrain.data.megatron): its
    dtype and size come from the index, and its sidecar, optional, has no dtype; without one the
    returned dict has no vocab_size (the tokeniser that wrote the corpus must supply it).
    """
    path = Path(path)
    side = sidecar_path(path)
    if is_megatron(path):
        return _open_megatron_file(path, side)
    example = '{"dtype": "uint16", "vocab_size": 50257}'
    if not side.is_file():
        raise ValueError(f"token file {path} has no sidecar {side.name}; write one, e.g. {example} "
                         "(uint16 when vocab_size <= 65536, else uint32, little-endian, no header)")
    meta = _read_sidecar(side, example)
    dtype_name, vocab_size = meta.get("dtype"), meta.get("vocab_size")
    if dtype_name not in TOKEN_DTYPES:
        raise ValueError(f"{side}: dtype ({dtype_name!r}) must be one of 'uint16', 'uint32'")
    if not (isinstance(vocab_size, int) and 0 < vocab_size <= np.iinfo(TOKEN_DTYPES[dtype_name]).max + 1):
        raise ValueError(f"{side}: vocab_size ({vocab_size!r}) must be an int in [1, "
                         f"{np.iinfo(TOKEN_DTYPES[dtype_name]).max + 1}] for dtype {dtype_name}")
    _check_eos_id(side, meta, vocab_size)
    dtype = TOKEN_DTYPES[dtype_name]
    num_bytes = path.stat().st_size
    if num_bytes % dtype.itemsize:
        raise ValueError(f"token file {path} has {num_bytes} bytes, not a multiple of {dtype.itemsize} "
                         f"({dtype_name}); is the dtype in {side.name} right?")
    num_tokens = num_bytes // dtype.itemsize
    if "num_tokens" in meta and not _is_int(meta["num_tokens"]):
        raise ValueError(f"{side}: num_tokens ({meta['num_tokens']!r}) must be an int, the number of tokens "
                         f"in {path.name} ({num_tokens})")
    if "num_tokens" in meta and meta["num_tokens"] != num_tokens:
        raise ValueError(f"{side}: num_tokens ({meta['num_tokens']!r}) does not match the {num_tokens} "
                         f"tokens in {path.name}; the file is truncated or the sidecar is stale")
    meta = {**meta, "num_tokens": num_tokens}
    if num_tokens == 0:
        return np.zeros(0, dtype=dtype), meta
    return np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,)), meta


def _open_megatron_file(path: Path, side: Path) -> tuple[np.ndarray, dict]:
    tokens, index = open_megatron(path)
    meta: dict = {}
    if side.is_file():
        meta = _read_sidecar(side, '{"vocab_size": 50257, "eos_id": 50256}')
        vocab_size = meta.get("vocab_size")
        if not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size > 0):
            raise ValueError(f"{side}: vocab_size ({vocab_size!r}) must be an int >= 1")
        _check_eos_id(side, meta, vocab_size)
    meta = {**meta, "dtype": index.dtype.name, "num_tokens": len(tokens), "format": "megatron",
            "num_documents": max(0, len(index.document_indices) - 1)}
    return tokens, meta


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no count


def _read_sidecar(side: Path, example: str) -> dict:
    """A token file's sidecar: a JSON object, else a ValueError naming the file."""
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{side} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{side} holds a JSON {type(meta).__name__} ({meta!r:.60}); it must be an object, "
                         f"e.g. {example}")
    return meta


def _check_eos_id(side: Path, meta: dict, vocab_size: int) -> None:
    """eos_id ends every document (data.document_mask finds documents by it): None or a token id."""
    eos_id = meta.get("eos_id")
    if eos_id is not None and not (_is_int(eos_id) and 0 <= eos_id < vocab_size):
        raise ValueError(f"{side}: eos_id ({eos_id!r}) must be null or an int in [0, vocab_size={vocab_size})")


def encode_texts(texts: Sequence[str], tokenizer, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the token ids of ``texts`` back to back [N] in ``dtype``, tokens per document [num_texts]):
    every document followed by the end-of-text id, or, with no such id, ending in a newline (the
    rule of the token cache, so prepared shards and cached corpora tokenise alike)."""
    eos_id = tokenizer.eos_id
    if eos_id is None:
        texts = [t if t.endswith("\n") else t + "\n" for t in texts]
    if tokenizer.key == "bytes":  # the bytes are the ids: no per-token Python objects
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        return np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(dtype), lengths
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    if eos_id is not None:
        tokens = np.insert(tokens, np.cumsum(lengths), np.asarray(eos_id, dtype=dtype))
        lengths += 1
    return tokens, lengths


def _encoded_batches(documents: Iterable[str], tokenizer) -> Iterable[list[list[int]]]:
    """Token ids of every document, a batch of documents at a time, each followed by eos (BPE) or
    ending in a newline (bytes)."""
    batch: list[str] = []
    batch_chars = 0

    def flush() -> list[list[int]]:
        encoded = tokenizer.encode_batch(batch)
        if tokenizer.eos_id is not None:
            encoded = [ids + [tokenizer.eos_id] for ids in encoded]
        return encoded

    for text in documents:
        if tokenizer.eos_id is None and not text.endswith("\n"):
            text += "\n"
        batch.append(text)
        batch_chars += len(text)
        if batch_chars >= _ENCODE_BATCH_CHARS:
            yield flush()
            batch, batch_chars = [], 0
    if batch:
        yield flush()


def _encoded_documents(documents: Iterable[str], tokenizer) -> Iterable[np.ndarray]:
    """The token stream of ``documents``, one flat array per batch of documents."""
    for encoded in _encoded_batches(documents, tokenizer):
        yield np.fromiter((i for ids in encoded for i in ids), dtype=np.int64)


def write_token_shards(documents: Iterable[str], tokenizer, out_dir: str | os.PathLike, *,
                       shard_tokens: int = 1 << 26, prefix: str = "shard") -> list[Path]:
    """Tokenise ``documents`` into ``out_dir/PREFIX-00000.bin``, ``-00001.bin``, ... (a data source of
    .bin shards), each with its sidecar naming ``eos_id`` and the tokeniser's ``key``.

    A shard is cut at the first document boundary at or after ``shard_tokens`` tokens, so no
    document is split over two shards, and every document is followed by the end-of-text id (BPE),
    as in the token cache. At most one shard is held in memory. Returns the shard paths in order.
    """
    if not (isinstance(shard_tokens, int) and shard_tokens >= 1):
        raise ValueError(f"shard_tokens ({shard_tokens!r}) must be an int >= 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    paths: list[Path] = []
    pending: list[np.ndarray] = []
    num_pending = 0

    def write() -> None:
        path = out_dir / f"{prefix}-{len(paths):05d}.bin"
        write_token_file(path, [np.concatenate(pending)], vocab_size=tokenizer.vocab_size,
                         eos_id=tokenizer.eos_id, tokenizer=tokenizer.key)
        paths.append(path)

    for encoded in _encoded_batches(documents, tokenizer):
        for ids in encoded:
            pending.append(np.asarray(ids, dtype=dtype))
            num_pending += len(ids)
            if num_pending >= shard_tokens:
                write()
                pending, num_pending = [], 0
    if pending:
        write()
    return paths


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the last round(N * val_fraction) tokens, so no window spans both."""
    num_val = round(len(tokens) * val_fraction)
    return tokens[:len(tokens) - num_val], tokens[len(tokens) - num_val:]


def load_or_build_tokens(documents, tokenizer, *, cache_dir: str | os.PathLike | None = None
                         ) -> tuple[np.ndarray, dict, Path]:
    """The token stream of ``documents`` under ``tokenizer``, memory-mapped from ``tokens/``.

    Tokenised once and cached, keyed by the documents' content hash and the tokeniser's key; later
    calls only map the file. Returns (tokens [N], sidecar, path).
    """
    path = resolve_cache_dir(cache_dir) / "tokens" / f"{documents.fingerprint[:16]}-{tokenizer.key}.bin"

    def build() -> None:
        num_tokens = write_token_file(path, _encoded_documents(documents, tokenizer),
                                      vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                                      tokenizer=tokenizer.key, documents=documents.fingerprint)
        if num_tokens == 0:
            raise ValueError(f"{documents.label} has no text: every document is empty")

    tokens, meta = open_or_build_token_file(path, build)
    return tokens, meta, path


def open_or_build_token_file(path: Path, build: Callable[[], None]) -> tuple[np.ndarray, dict]:
    """The cached token file at ``path`` (``open_token_file``); when it is absent, or a ``.bin``
    whose sidecar a killed run never wrote, ``build`` writes it first."""
    try:
        return open_token_file(path)
    except (OSError, ValueError):
        pass  # absent or half-written: rebuild
    build()
    return open_token_file(path)
