"""``moetrain data prepare``: jsonl / parquet / arrow corpora tokenised by worker processes into
token shards, resumable after a kill.

The output folder (a data source as it is: ``data.corpus=path``, ``data.path=OUT``)::

    shard-IIIII-SSSSS.bin (+ .bin.json)   the documents of records [S*shard_docs, (S+1)*shard_docs)
                                          of input I (+ .idx with --format megatron)
    index.json       the shards in order: input, first record, records, documents, tokens, bad records
    manifest.json    written last: inputs with their sha256, the tokeniser (spec, key, sha256),
                     the options, the totals and the bad records (the first 100)
    tokenizer.json   with --tokenizer bpe: the BPE trained on a sample of the inputs (+ its
                     tokenizer_config.json naming the end-of-text token)
    progress.json    while unfinished: the position reached and the shards done

Determinism: shard boundaries depend only on the inputs and ``shard_docs`` (records counted per
input), never on the number of workers or on timing, and the workers' results are written in input
order. Resuming: a shard is written to a hidden ``.NAME.partial`` file and renamed, then
``progress.json`` is replaced; a rerun with the same inputs and options skips the records of the
shards it records and removes partial files, so a run killed at any point and rerun ends with the
same bytes as one that was never killed (tested with SIGKILL).

Memory: the process that reads the inputs keeps at most ``2 * num_workers`` batches in flight, of
at most ``batch_docs`` records and about ``batch_chars`` characters each, and streams each shard
to disk as its batches return; no shard or file is held whole (a parquet row group's text column is).

Bad input (a line that is not JSON, a record without the text field, a file that cannot be read)
raises `BadInputError` naming the file and line (row group and row for parquet); the shards
finished before it stay, and a rerun resumes from them. With ``skip_bad`` such records (or the rest
of such a file) are skipped, counted and listed in the manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from moetrain.data.cache import sha256_file
from moetrain.data.inputs import BadInputError, Input, RawBatch, discover_inputs, parse_record, read_batches
from moetrain.data.megatron import megatron_dtype
from moetrain.data.prepare_output import (
    ShardWriter,
    load_tokenizer,
    remove_partials,
    tokenizer_record,
    write_json,
)
from moetrain.data.sources import BPE_SAMPLE_CHARS
from moetrain.data.tokens import encode_texts, token_dtype

FORMATS = ("moetrain", "megatron")
MAX_BAD_LISTED = 100


@dataclass
class EncodedBatch:
    """What a worker returns for one `RawBatch`."""

    input_index: int
    first_record: int
    num_records: int
    tokens: np.ndarray
    """The batch's documents back to back, in the shard dtype."""

    lengths: np.ndarray
    """int64 [documents]: tokens per document (end-of-text included)."""

    bad: list[str]


_WORKER: dict = {}


def _init_worker(tokenizer, dtype: str, text_field: str) -> None:
    # One core per worker: N workers use N cores, and the figure per core means what it says.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tokenizer, dtype=np.dtype(dtype), field=text_field)


def encode_batch(batch: RawBatch) -> EncodedBatch:
    """Parse (jsonl) and tokenise one batch in a worker; bad records become messages."""
    texts, bad = [], []
    for item, location in zip(batch.items, batch.locations, strict=True):
        try:
            text = parse_record(item, location, _WORKER["field"])
        except BadInputError as e:
            bad.append(str(e))
            continue
        if text:  # an empty document would only add a lone end-of-text token
            texts.append(text)
    tokens, lengths = encode_texts(texts, _WORKER["tokenizer"], _WORKER["dtype"])
    return EncodedBatch(batch.input_index, batch.first_record, len(batch.items), tokens, lengths, bad)


@dataclass
class PrepareOptions:
    out_dir: Path
    tokenizer: str = "bpe"
    """"bpe" (trained on a sample of the inputs), "bytes" or the path of a tokenizer.json."""

    text_field: str = "text"
    num_workers: int = 1
    """Tokenising processes; 0 tokenises in the calling process."""

    skip_bad: bool = False
    output_format: str = "moetrain"
    shard_docs: int = 1 << 17
    vocab_size: int = 4096
    """Size of the BPE trained with tokenizer "bpe"."""

    batch_docs: int = 1024
    batch_chars: int = 1 << 20

    def check(self) -> None:
        bad = []
        if not self.text_field:
            bad.append("--field ('') must name the field that holds the text")
        if not (isinstance(self.num_workers, int) and self.num_workers >= 0):
            bad.append(f"--workers ({self.num_workers!r}) must be an int >= 0")
        if self.output_format not in FORMATS:
            bad.append(f"--format ({self.output_format!r}) must be one of {', '.join(FORMATS)}")
        if self.tokenizer == "bpe" and not (isinstance(self.vocab_size, int) and self.vocab_size >= 257):
            bad.append(f"--vocab-size ({self.vocab_size!r}) must be an int >= 257 (256 bytes + eos)")
        for name in ("shard_docs", "batch_docs", "batch_chars"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                bad.append(f"--{name.replace('_', '-')} ({value!r}) must be an int >= 1")
        if bad:
            raise ValueError("; ".join(bad))


@dataclass
class Progress:
    """What ``progress.json`` records: where to resume and what is done."""

    identity: dict
    input_index: int = 0
    record: int = 0
    shards: list[dict] = field(default_factory=list)
    inputs: dict[str, dict] = field(default_factory=dict)
    """Per input index (a string: JSON keys): sha256, records, documents, bad records, read error."""

    bad: list[str] = field(default_factory=list)

    def save(self, out: Path) -> None:
        write_json(out / "progress.json", self.__dict__)


def prepare_corpus(inputs: list[str | os.PathLike], options: PrepareOptions, *,
                   log: Callable[[str], None] = print) -> dict:
    """Prepare ``inputs`` into ``options.out_dir`` (see the module docstring); returns the manifest."""
    options.check()
    found = discover_inputs(inputs)
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        tokenizer, tokenizer_sha = load_tokenizer(options.tokenizer, inputs=found, out=out,
                                                  text_field=options.text_field, vocab_size=options.vocab_size,
                                                  sample_chars=BPE_SAMPLE_CHARS, skip_bad=options.skip_bad, log=log)
        identity = _identity(found, options, tokenizer, tokenizer_sha)
        manifest_path = out / "manifest.json"
        if manifest_path.is_file():
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            _check_identity(out, manifest.get("identity"), identity, "manifest.json")
            log(f"{out}: already prepared ({manifest['num_tokens']} tokens)")
            return manifest
        progress = _load_progress(out, identity)
        remove_partials(out)
        dtype = megatron_dtype(tokenizer.vocab_size) if options.output_format == "megatron" \
            else token_dtype(tokenizer.vocab_size)
        sidecar = {"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.key}

        def new_shard(input_index: int, shard_index: int) -> ShardWriter:
            return ShardWriter(out, input_index=input_index, shard_index=shard_index,
                               first_record=shard_index * options.shard_docs, dtype=dtype,
                               output_format=options.output_format, sidecar=sidecar)

        _run(found, options, tokenizer, dtype, progress, out, new_shard, log=log)
        manifest = _manifest(found, options, tokenizer, tokenizer_sha, identity, progress, dtype)
        write_json(out / "index.json", {"shards": progress.shards})
        write_json(manifest_path, manifest)
        (out / "progress.json").unlink()
    return manifest


def _run(found: list[Input], options: PrepareOptions, tokenizer, dtype: np.dtype, progress: Progress, out: Path,
         new_shard: Callable[[int, int], ShardWriter], *, log: Callable[[str], None]) -> None:
    """Feed the batches to the workers, write their results in order, one shard at a time."""
    writer: ShardWriter | None = None
    try:
        for event in _ordered_results(_events(found, options, progress), options, tokenizer, dtype):
            if isinstance(event, EncodedBatch):
                writer = _add_batch(event, writer, options, progress, out, new_shard)
                continue
            kind, i, payload = event
            stats = progress.inputs.setdefault(str(i), {"records": 0, "documents": 0, "bad": 0})
            if kind == "start":
                stats["sha256"] = payload
            elif kind == "read_error":
                if not options.skip_bad:
                    raise BadInputError(payload)
                stats["read_error"] = payload
                stats["bad"] += 1
                _note_bad(progress, [payload])
            else:  # "end": the input's last shard, however short, then the next input
                if writer is not None:
                    _finish_shard(writer, progress, out)
                    writer = None
                progress.input_index, progress.record = i + 1, 0
                progress.save(out)
                log(f"{found[i].path}: {stats['documents']} documents, {stats['bad']} bad records")
    finally:
        if writer is not None:
            writer.abort()


def _add_batch(batch: EncodedBatch, writer: ShardWriter | None, options: PrepareOptions, progress: Progress,
               out: Path, new_shard: Callable[[int, int], ShardWriter]) -> ShardWriter | None:
    if batch.bad and not options.skip_bad:
        raise BadInputError(batch.bad[0] + (f" (and {len(batch.bad) - 1} more bad records in the same batch; "
                                            "--skip-bad skips and counts them)" if len(batch.bad) > 1 else
                                            "; --skip-bad skips and counts such records"))
    shard = batch.first_record // options.shard_docs
    if writer is None:
        writer = new_shard(batch.input_index, shard)
    assert (writer.input_index, writer.shard_index) == (batch.input_index, shard), "batches arrive in order"
    writer.append(batch.tokens, batch.lengths, num_records=batch.num_records, num_bad=len(batch.bad))
    _note_bad(progress, batch.bad)
    stats = progress.inputs[str(batch.input_index)]
    stats["records"] += batch.num_records
    stats["documents"] += len(batch.lengths)
    stats["bad"] += len(batch.bad)
    if (batch.first_record + batch.num_records) % options.shard_docs == 0:
        _finish_shard(writer, progress, out)
        return None
    return writer


def _finish_shard(writer: ShardWriter, progress: Progress, out: Path) -> None:
    """Rename the shard into place, then record it: a kill between the two redoes this shard."""
    entry = writer.finish()
    if entry is not None:
        progress.shards.append(entry)
    progress.input_index, progress.record = writer.input_index, writer.first_record + writer.num_records
    progress.save(out)


def _note_bad(progress: Progress, messages: list[str]) -> None:
    progress.bad.extend(messages[:max(0, MAX_BAD_LISTED - len(progress.bad))])


def _events(found: list[Input], options: PrepareOptions, progress: Progress) -> Iterator:
    """In input order: ("start", i, sha256), the batches, ("read_error", i, message), ("end", i, None)."""
    for i in range(progress.input_index, len(found)):
        inp = found[i]
        start = progress.record if i == progress.input_index else 0
        known = progress.inputs.get(str(i), {}).get("sha256")
        yield "start", i, known or _input_sha256(inp)
        try:
            yield from read_batches(inp, i, text_field=options.text_field, start_record=start,
                                    batch_docs=options.batch_docs, batch_chars=options.batch_chars,
                                    shard_docs=options.shard_docs)
        except BadInputError as e:
            yield "read_error", i, str(e)
        yield "end", i, None


def _ordered_results(events: Iterator, options: PrepareOptions, tokenizer, dtype: np.dtype) -> Iterator:
    """The events with each batch replaced by its `EncodedBatch`, in order, at most
    ``2 * num_workers`` batches in flight (the memory bound)."""
    init_args = (tokenizer, dtype.name, options.text_field)
    if options.num_workers == 0:
        _init_worker(*init_args)
        for event in events:
            yield encode_batch(event) if isinstance(event, RawBatch) else event
        return
    max_in_flight = 2 * options.num_workers
    # fork: a worker starts in milliseconds, where spawn re-imports the package (torch: seconds each).
    # Safe: the children run no torch and none of the parent's threads; tokenizers' thread pool
    # (used if a BPE was just trained here) stays off in them, which this variable says before fork.
    with _environment(TOKENIZERS_PARALLELISM="false"), \
            ProcessPoolExecutor(options.num_workers, mp_context=get_context("fork"), initializer=_init_worker,
                                initargs=init_args) as pool:
        pending: deque = deque()
        try:
            for event in events:
                pending.append(pool.submit(encode_batch, event) if isinstance(event, RawBatch) else event)
                while sum(isinstance(p, Future) for p in pending) >= max_in_flight or \
                        (pending and not isinstance(pending[0], Future)):
                    head = pending.popleft()
                    yield head.result() if isinstance(head, Future) else head
            while pending:
                head = pending.popleft()
                yield head.result() if isinstance(head, Future) else head
        finally:
            for p in pending:
                if isinstance(p, Future):
                    p.cancel()


def _input_sha256(inp: Input) -> str:
    if inp.path.is_file():
        return sha256_file(inp.path)
    digest = hashlib.sha256(b"moetrain-folder-v1")  # a saved dataset: its files, by relative path
    for path in sorted(p for p in inp.path.rglob("*") if p.is_file()):
        digest.update(path.relative_to(inp.path).as_posix().encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


def _identity(found: list[Input], options: PrepareOptions, tokenizer, tokenizer_sha: str | None) -> dict:
    """What a resumed run must share with the one it continues (stat, not content, of the inputs:
    hashing a terabyte on every start would cost more than it protects). The eos id with the
    tokenizer's file: it comes from the files beside tokenizer.json and ends every document."""
    def stat(path: Path) -> list[int]:
        s = path.stat()
        return [s.st_size, s.st_mtime_ns]

    return {"inputs": [[str(i.path), i.kind, *stat(i.path)] for i in found], "text_field": options.text_field,
            "tokenizer": {"spec": options.tokenizer, "sha256": tokenizer_sha, "eos_id": tokenizer.eos_id},
            "shard_docs": options.shard_docs, "format": options.output_format}


def _check_identity(out: Path, found: dict | None, expected: dict, name: str) -> None:
    if found != expected:
        differs = sorted(k for k in expected if (found or {}).get(k) != expected[k])
        raise ValueError(f"--out ({str(out)!r}) holds a prepare of other inputs or options ({name}: "
                         f"{', '.join(differs) or 'unreadable'} differ); use another --out or delete it")


def _load_progress(out: Path, identity: dict) -> Progress:
    path = out / "progress.json"
    if not path.is_file():
        if any(out.glob("shard-*.bin")):
            raise ValueError(f"--out ({str(out)!r}) holds shards but no progress.json or manifest.json; "
                             "use another --out or delete it")
        # Written before any shard: a folder killed after its first shard is then still known as
        # unfinished (refused as training data, resumed by a rerun), never taken for a corpus.
        progress = Progress(identity)
        progress.save(out)
        return progress
    state = json.loads(path.read_text(encoding="utf-8"))
    if not state.get("shards") and not any(out.glob("shard-*.bin")):
        # A run that stopped before its first shard (bad input, a wrong --field) left nothing to
        # continue: the corrected command starts again here.
        progress = Progress(identity)
        progress.save(out)
        return progress
    _check_identity(out, state.get("identity"), identity, "progress.json")
    return Progress(**state)


def _manifest(found: list[Input], options: PrepareOptions, tokenizer, tokenizer_sha: str | None, identity: dict,
              progress: Progress, dtype: np.dtype) -> dict:
    inputs = [{"path": str(inp.path), "kind": inp.kind, **progress.inputs.get(str(i), {})}
              for i, inp in enumerate(found)]
    return {
        "format_version": 1, "output_format": options.output_format, "dtype": dtype.name,
        "tokenizer": tokenizer_record(options.tokenizer, tokenizer, tokenizer_sha),
        "text_field": options.text_field, "shard_docs": options.shard_docs,
        "num_shards": len(progress.shards),
        "num_tokens": sum(s["num_tokens"] for s in progress.shards),
        "num_documents": sum(s["num_documents"] for s in progress.shards),
        "num_bad": sum(i.get("bad", 0) for i in inputs), "bad": progress.bad,
        "inputs": inputs, "identity": identity,
    }


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """One prepare per output folder at a time (an flock, released by the kernel if we are killed)."""
    with open(out / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"--out ({str(out)!r}) is being written by another moetrain data prepare") from None
        yield
