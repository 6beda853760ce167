"""The inputs of ``moetrain data prepare``: jsonl (plain, .gz, .zst), parquet and Hugging Face
``datasets`` saved to disk, read as numbered records in batches that never hold a whole file.

A record is one non-blank line of a jsonl file, or one row of a parquet file or an arrow dataset;
records are numbered from 0 within their input, and that number (with the input's position on the
command line) is what fixes the shard boundaries of a prepare, so they do not depend on the number
of workers or on where a killed run stopped.

Reading costs here are kept small because they run in the one process that feeds the workers:
jsonl lines travel to the workers as raw bytes and are parsed there; a parquet file is read one
row group at a time (its other columns never), an arrow dataset one slice at a time.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetrain.data.documents import jsonl_lines, load_json_line, valid_text

INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
"""File names ``moetrain data prepare`` reads; a folder holding ``state.json`` is an arrow dataset."""


class BadInputError(ValueError):
    """A record or a file that cannot be read: the message names the file and the line, row group
    or row."""


@dataclass(frozen=True)
class Input:
    """One input of a prepare: a file, or the folder of a dataset saved by ``save_to_disk``."""

    path: Path
    kind: str
    """"jsonl", "jsonl.gz", "jsonl.zst", "parquet" or "arrow"."""


@dataclass
class RawBatch:
    """Consecutive records of one input, as the workers receive them.

    ``items`` are raw jsonl lines (bytes, parsed by the worker) or texts already extracted from a
    column (str, or None where the row has no value); ``locations[i]`` names record i in messages.
    """

    input_index: int
    first_record: int
    items: list = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    raw_json: bool = False


def input_kind(path: Path) -> str | None:
    if path.is_dir():
        return "arrow" if (path / "state.json").is_file() else None
    name = path.name
    for suffix in INPUT_SUFFIXES:
        if name.endswith(suffix):
            return suffix[1:]
    return None


def discover_inputs(paths: list[str | os.PathLike]) -> list[Input]:
    """The inputs named on the command line, in order; a folder that is not a saved dataset stands
    for the readable files under it, in path order (hidden entries skipped)."""
    out: list[Input] = []
    for given in paths:
        path = Path(given).expanduser()
        if not path.exists():
            raise ValueError(f"input ({str(given)!r}) does not exist")
        kind = input_kind(path)
        if kind is not None:
            out.append(Input(path, kind))
            continue
        if path.is_file():
            raise ValueError(f"input ({str(given)!r}) must end in one of {', '.join(INPUT_SUFFIXES)}, "
                             "or be a folder saved by datasets' save_to_disk")
        found = _scan_folder(path)
        if not found:
            raise ValueError(f"input ({str(given)!r}) holds no {', '.join(INPUT_SUFFIXES)} files or saved datasets")
        out.extend(found)
    if not out:
        raise ValueError("data prepare needs at least one INPUT")
    return out


def _scan_folder(root: Path) -> list[Input]:
    """The inputs under ``root`` in relative-path order: files by suffix, saved datasets as a whole
    (their own .arrow files are not inputs); hidden entries skipped."""
    found: list[Input] = []
    datasets: list[Path] = []
    for path in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()):
        # A folder sorts before its contents, so a dataset is known before its files come up.
        if any(part.startswith(".") for part in path.relative_to(root).parts) or \
                any(d in path.parents for d in datasets):
            continue
        kind = input_kind(path)
        if kind == "arrow":
            datasets.append(path)
        if kind is not None:
            found.append(Input(path, kind))
    return found


def read_batches(inp: Input, input_index: int, *, text_field: str, start_record: int, batch_docs: int,
                 batch_chars: int, shard_docs: int) -> Iterator[RawBatch]:
    """The records of ``inp`` from ``start_record`` on, in batches of at most ``batch_docs`` records
    and about ``batch_chars`` characters that never straddle a multiple of ``shard_docs``.

    Raises `BadInputError` naming the file when it cannot be opened or read (a corrupt archive, a
    file that is not parquet); the batches before it have been yielded.
    """
    records: Iterator[tuple[bytes | str | None, str]]
    if inp.kind == "parquet":
        records = _parquet_records(inp.path, text_field, start_record)
    elif inp.kind == "arrow":
        records = _arrow_records(inp.path, text_field, start_record)
    else:
        records = _jsonl_records(inp, start_record)
    batch = RawBatch(input_index, start_record, raw_json=inp.kind.startswith("jsonl"))
    num_chars = 0
    record = start_record
    try:
        for item, location in records:
            batch.items.append(item)
            batch.locations.append(location)
            num_chars += len(item) if item is not None else 0
            record += 1
            if len(batch.items) >= batch_docs or num_chars >= batch_chars or record % shard_docs == 0:
                yield batch
                batch = RawBatch(input_index, record, raw_json=batch.raw_json)
                num_chars = 0
    except BadInputError:
        if batch.items:  # the records read before a file turns out unreadable are kept
            yield batch
        raise
    if batch.items:
        yield batch


def _open_jsonl(inp: Input):
    if inp.kind == "jsonl.gz":
        return gzip.open(inp.path, "rb")
    if inp.kind == "jsonl.zst":
        # A buffer in front of the frame reader gives line iteration.
        return io.BufferedReader(_ZstdFrames(inp.path), buffer_size=1 << 20)
    return open(inp.path, "rb")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a .zst file, each frame by its own decompressobj.

    zstandard's stream reader returns end-of-file where a truncated file is cut, so a cut .zst read
    as a shorter file; here the end of the input inside a frame raises EOFError, as gzip does.
    """

    def __init__(self, path: Path, chunk: int = 1 << 16):
        import zstandard

        self._zstd = zstandard
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close)
        self._chunk = chunk  # compressed bytes per step: bounds the output of one decompress call
        self._frame: Any = None  # the decompressobj of the frame being read; None between frames
        self._unused = b""  # input after the end of the last frame: the start of the next
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._out:
            if not self._step():
                return 0
        n = min(len(buf), len(self._out))
        buf[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _step(self) -> bool:
        """Decompress the next piece of input into ``self._out``; False at the end of the last frame."""
        data, self._unused = self._unused or self._file.read(self._chunk), b""
        if not data:
            if self._frame is not None:
                raise EOFError("the file ends inside a zstd frame (truncated)")
            return False
        frame = self._frame or self._zstd.ZstdDecompressor().decompressobj()
        try:
            self._out = memoryview(frame.decompress(data))
        except self._zstd.ZstdError as e:  # not an OSError or ValueError: named here for the caller
            raise OSError(str(e)) from None
        self._frame = None if frame.eof else frame
        if frame.eof:
            self._unused = frame.unused_data
        return True

    def close(self) -> None:
        self._file.close()
        super().close()


def _jsonl_records(inp: Input, start_record: int) -> Iterator[tuple[bytes, str]]:
    """(raw line, "PATH:LINE") of every non-blank line from record ``start_record`` on."""
    record = 0
    line_no = 0
    try:
        with _open_jsonl(inp) as f:
            for line_no, line in jsonl_lines(f):
                if record >= start_record:
                    yield line, f"{inp.path}:{line_no}"
                record += 1
    except (OSError, EOFError, ValueError) as e:  # gzip.BadGzipFile is an OSError; zstd errors become OSErrors
        raise BadInputError(f"{inp.path}: cannot be read after line {line_no} ({type(e).__name__}: {e})") from None


def _parquet_records(path: Path, text_field: str, start_record: int) -> Iterator[tuple[str | None, str]]:
    """(text, "PATH (row group G, row R)") per row, read one row group (one column) at a time."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise BadInputError(f"{path}: cannot be read as parquet ({type(e).__name__}: {e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise BadInputError(f"{path} has no column {text_field!r} (columns: {', '.join(names)}); "
                            "choose one with --field")
    first = 0
    for group in range(pf.metadata.num_row_groups):
        num_rows = pf.metadata.row_group(group).num_rows
        if first + num_rows <= start_record:  # a resumed prepare skips whole row groups unread
            first += num_rows
            continue
        try:
            column = pf.read_row_group(group, columns=[text_field]).column(0)
        except Exception as e:
            raise BadInputError(f"{path} (row group {group}): cannot be read ({type(e).__name__}: {e})") from None
        texts = column.to_pylist()
        for row in range(max(0, start_record - first), num_rows):
            yield _as_text(texts[row]), f"{path} (row group {group}, row {row})"
        first += num_rows


def _arrow_records(path: Path, text_field: str, start_record: int, *, slice_rows: int = 4096
                   ) -> Iterator[tuple[str | None, str]]:
    """(text, "PATH (row R)") per row of a dataset saved with ``save_to_disk`` (memory-mapped)."""
    import datasets  # type: ignore[import-untyped]

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise BadInputError(f"{path}: cannot be read by datasets.load_from_disk ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise BadInputError(f"{path} is a DatasetDict with splits {', '.join(ds)}; name one split's folder, "
                            f"e.g. {path / next(iter(ds))}")
    if text_field not in ds.column_names:
        raise BadInputError(f"{path} has no column {text_field!r} (columns: {', '.join(ds.column_names)}); "
                            "choose one with --field")
    ds = ds.select_columns([text_field]).with_format("arrow")
    for first in range(start_record, len(ds), slice_rows):
        texts = ds[first:first + slice_rows].column(0).to_pylist()
        for i, text in enumerate(texts):
            yield _as_text(text), f"{path} (row {first + i})"


def _as_text(value) -> str | None:
    return value if isinstance(value, str) else None


def parse_record(item, location: str, text_field: str) -> str:
    """The text of one record; `BadInputError` naming ``location`` when it has none."""
    if isinstance(item, bytes):
        try:
            record = load_json_line(item)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            reason = e.msg if isinstance(e, json.JSONDecodeError) else f"not UTF-8: {e.reason}"
            raise BadInputError(f"{location} is not valid JSON ({reason})") from None
        item = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(item, str):
        raise BadInputError(f"{location} has no string field {text_field!r}")
    return valid_text(item)
