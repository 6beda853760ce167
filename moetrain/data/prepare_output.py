"""The files of ``moetrain data prepare`` (moetrain.data.prepare_corpus): shards written under a
hidden partial name and renamed, the tokeniser of the output, and small JSON records."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moetrain.data.cache import sha256_file
from moetrain.data.inputs import BadInputError, Input, parse_record, read_batches
from moetrain.data.megatron import write_index
from moetrain.data.tokenizer import EOS_TOKEN, ByteTokenizer, PretrainedTokenizer, Tokenizer, train_bpe
from moetrain.data.tokens import sidecar_path
from moetrain.utils.files import atomic_write_text

PARTIAL_SUFFIX = ".partial"


def write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def remove_partials(out: Path) -> None:
    """Remove what a killed prepare left half-written (its shards are redone)."""
    for path in out.glob(f".*{PARTIAL_SUFFIX}"):
        path.unlink()
    for path in out.glob(".*.tmp-*"):  # atomic_write_text's temporaries
        path.unlink()


class ShardWriter:
    """One shard, streamed to ``.NAME.bin.partial`` as its batches arrive and published by
    `finish`: sidecar (and .idx) first, the .bin last, so a .bin in the folder is always complete."""

    def __init__(self, out: Path, *, input_index: int, shard_index: int, first_record: int, dtype: np.dtype,
                 output_format: str, sidecar: dict) -> None:
        self.out = out
        self.input_index = input_index
        self.shard_index = shard_index
        self.first_record = first_record
        self.dtype = dtype
        self.output_format = output_format
        self.sidecar = sidecar
        self.name = f"shard-{input_index:05d}-{shard_index:05d}"
        self.partial = out / f".{self.name}.bin{PARTIAL_SUFFIX}"
        self.file = open(self.partial, "wb")  # noqa: SIM115 (closed by finish or abort)
        self.lengths: list[np.ndarray] = []
        self.num_records = self.num_tokens = self.num_bad = 0

    def append(self, tokens: np.ndarray, lengths: np.ndarray, *, num_records: int, num_bad: int) -> None:
        np.asarray(tokens, dtype=self.dtype).tofile(self.file)
        self.lengths.append(lengths)
        self.num_records += num_records
        self.num_tokens += len(tokens)
        self.num_bad += num_bad

    def finish(self) -> dict | None:
        """Publish the shard; its index entry, or None when it has no documents (no file)."""
        self.file.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        if len(lengths) == 0:
            self.partial.unlink()
            return None
        path = self.out / f"{self.name}.bin"
        meta = {"vocab_size": self.sidecar["vocab_size"], "num_tokens": self.num_tokens,
                "eos_id": self.sidecar["eos_id"], "tokenizer": self.sidecar["tokenizer"]}
        if self.output_format == "megatron":
            idx_partial = self.out / f".{self.name}.idx{PARTIAL_SUFFIX}"
            write_index(idx_partial, dtype=self.dtype, sequence_lengths=lengths)
            os.replace(idx_partial, path.with_suffix(".idx"))
            meta = {"format": "megatron", **meta}
        else:
            meta = {"dtype": self.dtype.name, **meta}
        write_json(sidecar_path(path), meta)
        os.replace(self.partial, path)
        return {"file": path.name, "input": self.input_index, "first_record": self.first_record,
                "num_records": self.num_records, "num_documents": len(lengths), "num_tokens": self.num_tokens,
                "num_bad": self.num_bad}

    def abort(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def load_tokenizer(spec: str, *, inputs: list[Input], out: Path, text_field: str, vocab_size: int,
                   sample_chars: int, skip_bad: bool, log: Callable[[str], None]) -> tuple[Tokenizer, str | None]:
    """(the tokeniser named by ``--tokenizer``, the sha256 of its file or None for bytes).

    "bpe" is trained on the first ``sample_chars`` characters of the inputs and written to
    ``OUT/tokenizer.json`` with a ``tokenizer_config.json`` naming its end-of-text token (and the
    ``--vocab-size`` asked for), so that ``data.tokenizer=OUT/tokenizer.json`` reads it back with
    the same ids and key; a resumed run reads it instead of training again, and refuses another
    ``--vocab-size`` (the shards so far are in the old vocabulary: `_check_vocab_size`).
    """
    if spec == "bytes":
        return ByteTokenizer(), None
    if spec.endswith(".json"):
        return PretrainedTokenizer.from_file(spec), sha256_file(spec)
    if spec != "bpe":
        raise ValueError(f"--tokenizer ({spec!r}) must be 'bpe', 'bytes' or the path of a tokenizer.json")
    path = out / "tokenizer.json"
    if not path.is_file():
        log(f"training a BPE of {vocab_size} tokens on the first {sample_chars >> 20} MB of text")
        bpe = train_bpe(_sample(inputs, text_field, sample_chars, skip_bad), vocab_size=vocab_size)
        write_json(out / "tokenizer_config.json", {"eos_token": EOS_TOKEN, VOCAB_SIZE_KEY: vocab_size})
        bpe.save(path)
    tokenizer = PretrainedTokenizer.from_file(path)
    _check_vocab_size(tokenizer, path, vocab_size)
    return tokenizer, sha256_file(path)


VOCAB_SIZE_KEY = "moetrain_vocab_size"
"""The --vocab-size a prepare's BPE was trained with, in its tokenizer_config.json (a BPE may stop
short of it on a small corpus, so its size does not tell)."""


def _check_vocab_size(tokenizer: Tokenizer, path: Path, vocab_size: int) -> None:
    """Refuse a rerun that asks for another --vocab-size than the BPE already in ``--out``: keeping
    the old one ignores the option, and training a new one would leave the shards written so far in
    the old vocabulary (or silently discard a finished output)."""
    config = path.parent / "tokenizer_config.json"
    try:
        trained = json.loads(config.read_text(encoding="utf-8")).get(VOCAB_SIZE_KEY)
    except (OSError, ValueError):
        trained = None
    if trained is None:  # written before the key existed: its size is the best record
        trained = tokenizer.vocab_size
    if trained != vocab_size:
        raise ValueError(f"--vocab-size ({vocab_size}) differs from the {trained} that {path} was trained with by "
                         f"an earlier data prepare into this --out; rerun with --vocab-size {trained} to continue "
                         "or reuse it, or use another --out (or delete this one) to train a new BPE")


def _sample(inputs: list[Input], text_field: str, sample_chars: int, skip_bad: bool):
    num_chars = 0
    for i, inp in enumerate(inputs):
        try:
            for batch in read_batches(inp, i, text_field=text_field, start_record=0, batch_docs=1024,
                                      batch_chars=1 << 20, shard_docs=1 << 62):
                for item, location in zip(batch.items, batch.locations, strict=True):
                    try:
                        text = parse_record(item, location, text_field)
                    except BadInputError:
                        if not skip_bad:
                            raise
                        continue
                    yield text
                    num_chars += len(text)
                    if num_chars >= sample_chars:
                        return
        except BadInputError:
            if not skip_bad:
                raise


def tokenizer_record(spec: str, tokenizer: Tokenizer, sha256: str | None) -> dict:
    return {"spec": spec, "key": tokenizer.key, "sha256": sha256, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id}
