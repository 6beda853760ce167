"""Text documents read from files: a registered corpus in the cache, or a user folder.

A document is one ``.txt`` file, or the ``"text"`` field of one line of a ``.jsonl`` file. Files are
taken in the order of their path relative to the root, so the same folder yields the same documents
(and the same token stream) on every machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from functools import cached_property
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIX = ".bin"


def read_utf8(path: Path) -> str:
    """A whole text file as UTF-8 (universal newlines), naming the file if it is not UTF-8."""
    try:
        with open(path, encoding="utf-8", newline=None) as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start}); "
                         "moetrain reads .txt/.jsonl files as UTF-8") from None


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """``text`` with every lone UTF-16 surrogate replaced by U+FFFD.

    JSON may escape one ("\\ud83d": half an emoji, cut by a crawler) and ``json.loads`` keeps it,
    giving a str that cannot be encoded as UTF-8, which every later stage does (tokenisers, cache
    hashes). Each JSON reader passes its texts through here; UTF-8 files cannot hold one. A valid
    pair is already one character after ``json.loads``, so any surrogate left is lone.
    """
    return _LONE_SURROGATE.sub("\ufffd", text)


UTF8_BOM = b"\xef\xbb\xbf"


def jsonl_lines(f: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line) of each non-blank line of a jsonl file opened in binary mode: the
    one reading rule of data.path and ``moetrain data prepare``, so both read the same records.

    A line ends at b"\n" only, its "\r" before it dropped (a lone "\r" stays inside the line, where
    JSON takes it for whitespace); a UTF-8 byte-order mark opening the file is skipped (one anywhere
    else is an error of its line, see `load_json_line`); blank means ASCII whitespace only.
    """
    for line_no, line in enumerate(f, start=1):
        if line_no == 1 and line.startswith(UTF8_BOM):
            line = line[len(UTF8_BOM):]
        if line.strip():
            yield line_no, line.rstrip(b"\r\n")


def load_json_line(line: bytes):
    """The JSON value of one jsonl line, decoded as UTF-8: UnicodeDecodeError or JSONDecodeError
    (``json.loads`` of bytes would also take UTF-16/32, and a byte-order mark on any line)."""
    return json.loads(line.decode("utf-8"))


def _jsonl_texts(path: Path) -> Iterator[str]:
    with open(path, "rb") as f:
        for line_no, line in jsonl_lines(f):
            try:
                record = load_json_line(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                reason = e.msg if isinstance(e, json.JSONDecodeError) else f"not UTF-8: {e.reason}"
                raise ValueError(f"{path}:{line_no} is not valid JSON ({reason}; a line ends at \\n only, "
                                 "and a blank one holds nothing but ASCII whitespace)") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                # A malformed input file is bad data (ValueError), not a programming error.
                raise ValueError(f"{path}:{line_no} must be a JSON object with a string field \"text\"")  # noqa: TRY004
            yield valid_text(text)


class Documents:
    """An ordered, re-iterable sequence of documents backed by files (read lazily, each pass).

    Args:
        files: ``.txt`` / ``.jsonl`` files, in the order their documents appear.
        label: what the documents are, for messages (e.g. "corpus 'shakespeare'").
        max_chars: a sample: stop after the document that brings the characters yielded to at
            least this many (None = every document). Reads only the files it needs.
    """

    def __init__(self, files: list[Path], *, label: str, max_chars: int | None = None) -> None:
        self.files = [Path(f) for f in files]
        self.label = label
        self.max_chars = max_chars

    def __iter__(self) -> Iterator[str]:
        num_chars = 0
        for path in self.files:
            if path.suffix == ".jsonl":
                texts = _jsonl_texts(path)
            else:
                texts = iter((read_utf8(path),))
            for text in texts:
                if text:  # an empty document would only add a lone end-of-text token
                    yield text
                    num_chars += len(text)
                    if self.max_chars is not None and num_chars >= self.max_chars:
                        return

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the documents themselves (not of paths or mtimes): the key of every cache entry
        derived from them, so equal text gives equal tokenisers and token files anywhere."""
        digest = hashlib.sha256(b"moetrain-documents-v1")
        for text in self:
            data = text.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
        return digest.hexdigest()


class ChainedDocuments:
    """The documents of several `Documents` one after the other (what a tokeniser shared by several
    sources is trained on), with a fingerprint over theirs."""

    def __init__(self, parts: list[Documents], *, label: str) -> None:
        self.parts = list(parts)
        self.label = label

    def __iter__(self) -> Iterator[str]:
        for part in self.parts:
            yield from part

    @cached_property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(b"moetrain-chained-documents-v1")
        for part in self.parts:
            digest.update(part.fingerprint.encode("ascii"))
        return digest.hexdigest()


def scan_user_path(path: str | os.PathLike, *, field: str = "data.path") -> tuple[str, list[Path]]:
    """Classify user data: ("text", [.txt/.jsonl files]) or ("tokens", [.bin files]), in path order.

    ``path`` is a folder (searched recursively, hidden entries skipped) or a single file; ``field``
    names it in messages (``data.path``, ``data.sources[1].path``).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"{field} ({str(path)!r}) does not exist")
    if root.is_file():
        candidates = [root]
    else:
        candidates = sorted(
            (p for p in root.rglob("*")
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)),
            key=lambda p: p.relative_to(root).as_posix())
    texts = [p for p in candidates if p.suffix in TEXT_SUFFIXES]
    tokens = [p for p in candidates if p.suffix == TOKEN_SUFFIX]
    _refuse_unfinished_prepare(tokens, field=field, path=path)
    if texts and tokens:
        raise ValueError(f"{field} ({str(path)!r}) mixes text files ({texts[0].name}, ...) and token "
                         f"files ({tokens[0].name}, ...); point it at one kind")
    if tokens:
        return "tokens", tokens
    if not texts:
        raise ValueError(f"{field} ({str(path)!r}) has no .txt, .jsonl or .bin files")
    return "text", texts


def _refuse_unfinished_prepare(tokens: list[Path], *, field: str, path: str | os.PathLike) -> None:
    """A ``moetrain data prepare`` output holds progress.json until its manifest.json is written
    (moetrain.data.prepare_corpus): its shards so far are only part of the corpus, and training
    on them would look like success."""
    for folder in sorted({p.parent for p in tokens}):
        if (folder / "progress.json").is_file() and not (folder / "manifest.json").is_file():
            raise ValueError(f"{field} ({str(path)!r}): {folder} is an unfinished `moetrain data prepare` output "
                             "(progress.json, no manifest.json), its shards only part of the corpus; rerun "
                             "`moetrain data prepare` with the same inputs and --out to finish it")


def document_separator(document_mask: bool, eos_id: int | None, *, what: str) -> int | None:
    """``model.document_separator`` for ``data.document_mask``: the end-of-text id that ends every
    packed document, or None when the mask is off. ``what`` names the data in the error raised
    when the mask is on and the data has no end-of-text id (no way to find document boundaries)."""
    if not document_mask:
        return None
    if eos_id is None:
        raise ValueError(f"data.document_mask (True) needs an end-of-text id to find where documents end, and "
                         f"{what} has none: use data.tokenizer=bpe (or a tokenizer.json with an end-of-text "
                         "token), or .bin files whose .bin.json names eos_id")
    return eos_id
