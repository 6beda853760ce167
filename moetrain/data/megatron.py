"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read and written without Megatron.

The layout, as ``megatron.core.datasets.indexed_dataset`` writes it (all little-endian):

- ``PREFIX.bin``: the token ids of every sequence back to back, no header, in the index's dtype.
- ``PREFIX.idx``: ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` (1), dtype code ``<B`` (1 uint8, 2 int8,
  3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), sequence count ``<Q``, document count
  ``<Q``, then the sequence lengths (int32 [S]), the sequences' byte offsets in the .bin (int64 [S]),
  the document indices (int64 [D]: the first sequence of each document, then the sequence count, so
  D = documents + 1) and, for multimodal data only, one int8 mode per sequence.

Megatron's ``preprocess_data.py`` writes one sequence per document (or per sentence with
``--split-sentences``), each followed by the end-of-text id with ``--append-eod``. moetrain trains
on the .bin as one token stream (documents packed back to back, as Megatron's GPTDataset samples it),
which needs the sequences stored in order with no gaps: checked when the index is opened.

The index holds no vocabulary size or end-of-text id. They come from a moetrain sidecar
``PREFIX.bin.json`` (written by ``moetrain data prepare --format megatron``) or, for a corpus
preprocessed elsewhere, from the tokeniser that wrote it (``data.tokenizer=PATH/tokenizer.json``).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"),
                                    4: np.dtype("<i4"), 5: np.dtype("<i8"), 6: np.dtype("<f8"),
                                    7: np.dtype("<f4"), 8: np.dtype("<u2")}
TOKEN_CODES = (1, 3, 4, 5, 8)
"""Dtype codes a token file may use (the float codes are for other modalities)."""


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocess_data.py picks (``DType.optimal_dtype``): uint16 below 65500
    ids, else int32."""
    return DTYPE_CODES[8] if vocab_size < 65500 else DTYPE_CODES[4]


def index_path(bin_path: str | os.PathLike) -> Path:
    return Path(bin_path).with_suffix(".idx")


def is_megatron(bin_path: str | os.PathLike) -> bool:
    """A .bin with an .idx beside it is Megatron's (moetrain's own .bin files have only a .json)."""
    return index_path(bin_path).is_file()


@dataclass
class MegatronIndex:
    """The contents of a ``.idx`` file (read-only views of a memory map)."""

    dtype: np.dtype
    sequence_lengths: np.ndarray
    """int32 [S]: tokens per sequence."""

    sequence_pointers: np.ndarray
    """int64 [S]: byte offset of each sequence in the .bin."""

    document_indices: np.ndarray
    """int64 [D + 1]: first sequence of each document, then S."""

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def read_index(path: str | os.PathLike) -> MegatronIndex:
    """Parse a ``.idx``; ValueError naming the file for a wrong header, version, dtype or size."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(34)
    if head[:len(INDEX_HEADER)] != INDEX_HEADER[:len(head)]:
        raise ValueError(f"{path} is not a Megatron index: it must start with {INDEX_HEADER!r}")
    if len(head) < 34:
        raise ValueError(f"{path} has {len(head)} bytes, fewer than the 34 of a Megatron index's header: truncated")
    version, code, num_sequences, num_documents = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        raise ValueError(f"{path}: index version ({version}) must be 1")
    if code not in TOKEN_CODES:
        raise ValueError(f"{path}: dtype code ({code}) must be one of {TOKEN_CODES} (integer token ids)")
    expected = 34 + num_sequences * (4 + 8) + num_documents * 8
    size = path.stat().st_size
    if size < expected:
        raise ValueError(f"{path} has {size} bytes, fewer than the {expected} its header announces "
                         f"({num_sequences} sequences, {num_documents} document indices): truncated")
    buffer = np.memmap(path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(buffer, dtype="<i4", count=num_sequences, offset=34)
    pointers = np.frombuffer(buffer, dtype="<i8", count=num_sequences, offset=34 + 4 * num_sequences)
    documents = np.frombuffer(buffer, dtype="<i8", count=num_documents, offset=34 + 12 * num_sequences)
    return MegatronIndex(DTYPE_CODES[code], lengths, pointers, documents)


def open_megatron(bin_path: str | os.PathLike) -> tuple[np.ndarray, MegatronIndex]:
    """(the .bin as one memory-mapped token stream [N], its index), after checking that the
    sequences fill the .bin in order with no gaps."""
    bin_path = Path(bin_path)
    index = read_index(index_path(bin_path))
    itemsize = index.dtype.itemsize
    lengths = index.sequence_lengths.astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize if len(lengths) else lengths
    if not np.array_equal(index.sequence_pointers, starts):
        bad = int(np.flatnonzero(index.sequence_pointers != starts)[0])
        raise ValueError(f"{index_path(bin_path)}: sequence {bad} starts at byte {index.sequence_pointers[bad]}, "
                         f"not {starts[bad]}: moetrain reads the .bin as one stream of the sequences in order")
    num_bytes = bin_path.stat().st_size
    if num_bytes != index.num_tokens * itemsize:
        raise ValueError(f"{bin_path} has {num_bytes} bytes but its index describes {index.num_tokens} "
                         f"{index.dtype.name} tokens ({index.num_tokens * itemsize} bytes)")
    if index.num_tokens == 0:
        return np.zeros(0, dtype=index.dtype), index
    return np.memmap(bin_path, dtype=index.dtype, mode="r", shape=(index.num_tokens,)), index


def write_index(path: str | os.PathLike, *, dtype: np.dtype, sequence_lengths: np.ndarray,
                document_indices: np.ndarray | None = None) -> None:
    """Write a ``.idx`` for sequences stored back to back (one per document unless
    ``document_indices`` says otherwise), as megatron-core's ``_IndexWriter`` would."""
    codes = {d: c for c, d in DTYPE_CODES.items()}
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype="<i4")
    if document_indices is None:
        document_indices = np.arange(len(lengths) + 1)
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * dtype.itemsize \
        if len(lengths) else np.zeros(0)
    with open(path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<QBQQ", 1, codes[dtype], len(lengths), len(document_indices)))
        f.write(lengths.tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(document_indices, dtype="<i8").tobytes())
