"""User data from several sources mixed by weight (``data.sources``, or a ``data.path`` of several
.bin shards), ready to be batched by `MixtureLoader`.

Each source is a folder (or file) of .txt/.jsonl documents or of .bin token shards (moetrain's, with a
.bin.json sidecar, or Megatron-LM's indexed dataset, .bin + .idx: moetrain.data.megatron). A text source
is tokenised once into the token cache (one token file per source, every document followed by the
end-of-text id, as for a corpus); shard files are memory-mapped as they are, never read whole.

One vocabulary for all. Text sources share the tokeniser of ``data.tokenizer``: "bpe" is trained
(and cached) on a sample of every text source, the first documents of each in path order up to
its weight's share of `BPE_SAMPLE_CHARS` characters, so the vocabulary fits the mixture the model
trains on; "bytes" and a tokenizer.json need no training. Shards bring their vocabulary in their
sidecars: every shard of every source must agree on vocab_size and eos_id (and, where both name
one, on the tokeniser key), and so must the text sources' tokeniser; otherwise a ValueError names
the two files that differ. A Megatron corpus preprocessed elsewhere has no sidecar, so no vocabulary
size: ``data.tokenizer`` must then name the tokenizer.json that wrote it, which gives vocab_size and
eos_id.

Validation: each file is split on its own, its last round(N * data.val_fraction) tokens held out
(the rule of `split_tokens`), so every source, and every shard of it, gives validation data in
proportion to its size; validation batches mix the sources with the training weights.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.config.data import DataConfig, DataSource
from moetrain.data.documents import ChainedDocuments, Documents, document_separator, scan_user_path
from moetrain.data.mixture import MixtureLoader
from moetrain.data.tokenizer import Tokenizer, build_tokenizer
from moetrain.data.tokens import load_or_build_tokens, open_token_file, split_tokens

BPE_SAMPLE_CHARS = 64 << 20
"""Characters of text a BPE shared by several sources is trained on, split over the text sources
by weight: enough for a 50k vocabulary, small enough to train in minutes."""


@dataclass
class SourceData:
    """One source's files, split into their train and val parts."""

    name: str
    """The configured path (names the source in messages and in the loader state)."""

    weight: float
    files: list[Path]
    """Token files: the cached token file of a text source, or the source's own .bin shards."""

    train: list[np.ndarray]
    """Per file, its train part (a read-only memmap view)."""

    val: list[np.ndarray]
    """Per file, its last `val_fraction` (disjoint from train)."""


@dataclass
class MixedData:
    """The token files of every source, ready to be batched (the interface of `PreparedData`)."""

    sources: list[SourceData]
    vocab_size: int
    """Ids are in [0, vocab_size): the model's embedding must be at least this big."""

    eos_id: int | None
    """End-of-text id after each document, or None (byte tokeniser, shards without one)."""

    tokenizer: Tokenizer | None
    """For encode/decode; None when every source is pre-tokenised (and no tokenizer.json is named)."""

    seq_len: int
    document_separator: int | None = None
    """``model.document_separator`` for ``data.document_mask``: the eos id, or None (mask off)."""

    def _loader(self, split: str, **kwargs) -> MixtureLoader:
        return MixtureLoader([getattr(s, split) for s in self.sources], [s.weight for s in self.sources],
                             names=[s.name for s in self.sources], seq_len=self.seq_len, name=split, **kwargs)

    def train_loader(self, *, global_batch_size: int, micro_steps: int = 1, dp_rank: int = 0, dp_size: int = 1,
                     seed: int = 0) -> MixtureLoader:
        """Shuffled, endless, resumable micro-batches of this rank's share of each global batch."""
        return self._loader("train", global_batch_size=global_batch_size, micro_steps=micro_steps,
                            dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=True)

    def val_loader(self, *, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> MixtureLoader:
        """Val windows of every source in stream order, mixed by weight; evaluate with
        ``loader.eval_batches(max_windows)``."""
        return self._loader("val", global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                            shuffle=False)


@dataclass
class _Scanned:
    index: int
    source: DataSource
    kind: str
    """"text" or "tokens"."""
    files: list[Path]

    @property
    def field(self) -> str:
        return f"data.sources[{self.index}]"


def prepare_sources(cfg: DataConfig, sources: list[DataSource], *, field: str = "data.sources") -> MixedData:
    """Tokenise (cached) the text sources, map the shard sources, check one vocabulary, split.

    ``field`` names the sources in messages ("data.path" when it is one folder of shards).
    """
    scanned = []
    for i, source in enumerate(sources):
        where = f"{field}[{i}].path" if field == "data.sources" else field
        kind, files = scan_user_path(source.path, field=where)
        scanned.append(_Scanned(i, source, kind, files))
    shard_meta, unsized = _shard_vocabulary(scanned)
    if unsized is not None and not cfg.tokenizer.endswith(".json"):
        raise ValueError(f"{unsized} is Megatron-LM indexed data (.bin + .idx) with no {unsized.name}.json sidecar, so "
                         f"no vocabulary size: set data.tokenizer (now {cfg.tokenizer!r}) to the tokenizer.json that "
                         'wrote it, or write a sidecar such as {"vocab_size": 50257, "eos_id": 50256}')
    texts = [s for s in scanned if s.kind == "text"]
    tokenizer = _shared_tokenizer(cfg, texts, shard_meta)
    if tokenizer is None:
        assert shard_meta is not None
        vocab_size, eos_id = shard_meta[1]["vocab_size"], shard_meta[1].get("eos_id")
    else:
        vocab_size, eos_id = tokenizer.vocab_size, tokenizer.eos_id
    separator = document_separator(cfg.document_mask, eos_id, what=f"the data of {field}")
    out = []
    for s in scanned:
        if s.kind == "text":
            documents = Documents(s.files, label=f"{s.field} {s.source.path!r}")
            tokens, _, path = load_or_build_tokens(documents, tokenizer, cache_dir=cfg.cache_dir)
            files, streams = [path], [tokens]
        else:
            files, streams = s.files, [open_token_file(f)[0] for f in s.files]
        parts = [split_tokens(t, cfg.val_fraction) for t in streams]
        out.append(SourceData(name=s.source.path, weight=float(s.source.weight), files=files,
                              train=[p[0] for p in parts], val=[p[1] for p in parts]))
    return MixedData(sources=out, vocab_size=vocab_size, eos_id=eos_id, tokenizer=tokenizer, seq_len=cfg.seq_len,
                     document_separator=separator)


def _shard_vocabulary(scanned: list[_Scanned]) -> tuple[tuple[Path, dict] | None, Path | None]:
    """((first shard with a vocabulary, its sidecar) after checking that every such shard agrees with
    it, or None; the first Megatron shard without a sidecar, or None). Opening a shard maps it and
    reads only its sidecar (and index)."""
    reference = None
    unsized = None
    for s in scanned:
        if s.kind != "tokens":
            continue
        for path in s.files:
            meta = open_token_file(path)[1]
            if "vocab_size" not in meta:
                unsized = unsized or path
            elif reference is None:
                reference = (path, meta)
            else:
                _check_same_vocabulary(reference, (path, meta))
    return reference, unsized


def _check_same_vocabulary(a: tuple[Path, dict], b: tuple[Path, dict]) -> None:
    """ValueError naming both files unless they agree on vocab_size, eos_id and (when both name
    one) the tokeniser key."""
    (path_a, meta_a), (path_b, meta_b) = a, b
    keys = ["vocab_size", "eos_id"] + (["tokenizer"] if "tokenizer" in meta_a and "tokenizer" in meta_b else [])
    for key in keys:
        if meta_a.get(key) != meta_b.get(key):
            raise ValueError(f"data sources must share one vocabulary: {key} is {meta_a.get(key)!r} for {path_a} "
                             f"but {meta_b.get(key)!r} for {path_b}")


def _shared_tokenizer(cfg: DataConfig, texts: list[_Scanned], shard_meta: tuple[Path, dict] | None
                      ) -> Tokenizer | None:
    """The tokeniser of the text sources (None when there are none and no tokenizer.json is named),
    checked against the shards' vocabulary."""
    if not texts and not cfg.tokenizer.endswith(".json"):
        assert shard_meta is not None, "sources without text are shards"
        warnings.warn(f"data.tokenizer ({cfg.tokenizer!r}) and data.vocab_size ({cfg.vocab_size}) are ignored "
                      f"for pre-tokenised data: vocab_size={shard_meta[1]['vocab_size']} comes from "
                      f"{shard_meta[0].name}.json", stacklevel=3)
        return None
    total = sum(s.source.weight for s in texts)
    sample = ChainedDocuments(
        [Documents(s.files, label=f"{s.field} {s.source.path!r}",
                   max_chars=max(1, round(BPE_SAMPLE_CHARS * s.source.weight / total))) for s in texts],
        label="a sample of the text sources")
    tokenizer = build_tokenizer(cfg.tokenizer, sample if texts else None, vocab_size=cfg.vocab_size,
                                cache_dir=cfg.cache_dir)
    if shard_meta is not None:
        meta = {"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.key}
        _check_same_vocabulary(shard_meta, (Path(f"the text sources' tokeniser (data.tokenizer={cfg.tokenizer!r})"),
                                            meta))
    return tokenizer
