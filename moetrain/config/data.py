"""Config of the training data: corpus or user sources, tokeniser, packing and loader."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from moetrain.config.base import require, require_active

TOKENIZER_KINDS = ("bpe", "bytes")
"""Names ``data.tokenizer`` accepts besides the path of a Hugging Face ``tokenizer.json``."""


@dataclass
class DataSource:
    """One entry of ``data.sources``: where its documents or token shards are, and its share."""

    path: str = ""
    """A folder (searched recursively, hidden entries skipped) or a single file of either .txt/.jsonl
    documents or pre-tokenised .bin shards with their .bin.json sidecars (moetrain.data.tokens), not
    both. Checked when the data is prepared."""

    weight: float = 1.0
    """Share of the training sequences drawn from this source: weight / (sum of all weights). > 0.
    Sources are mixed by weight, not by size: a small source with a large weight is repeated."""


@dataclass
class DataConfig:
    corpus: str = "shakespeare"
    """Registered corpus name (see `moetrain data list`), or "path" for user data in `data.path` or
    `data.sources`. The name is checked by the data layer, which owns the registry
    (``moetrain.data.registry.check_corpus``)."""

    path: str | None = None
    """User data (only with corpus="path"; refused with a registered corpus): a folder (or file) of
    .txt/.jsonl documents (jsonl: a "text" field per line), or of pre-tokenised .bin token files with
    their .bin.json sidecars (see moetrain.data.tokens for the format). Several .bin files are read
    as the shards of one source. Exclusive with `data.sources`."""

    sources: tuple[DataSource, ...] | None = None
    """User data mixed from several places (with corpus="path", instead of `data.path`): a list of
    ``{path, weight}`` (see `DataSource`). Every training step draws weight/sum(weights) of its
    sequences from each source (deterministic, see moetrain.data.mixture); each source holds out
    its own validation part (the tail `val_fraction` of each file). Text sources share one
    tokeniser (`data.tokenizer`; "bpe" is trained on a weight-proportional sample of all text
    sources); .bin sources must agree with it and with each other on vocab_size and eos_id."""

    tokenizer: str = "bpe"
    """"bpe": byte-level BPE trained on the corpus and cached; "bytes": raw UTF-8 bytes (vocab 256, no
    end-of-text id); or the path of a Hugging Face ``tokenizer.json`` (ends in ".json"), whose
    vocabulary is used as it is. Ignored for .bin data."""

    vocab_size: int = 4096
    """Target vocabulary of the BPE tokeniser, eos included (used by "bpe" only; the other tokenisers
    and .bin data bring their own). A small corpus may stop short of it: the model must use the
    prepared data's vocab_size."""

    seq_len: int = 256
    """Tokens per training sequence. Documents are packed back to back, each followed by the
    end-of-text id, so a sequence may hold several documents and parts of documents."""

    document_mask: bool = False
    """Attention within each document only (a block-diagonal causal mask over the packed sequence):
    the trainer sets `model.document_separator` to the data's end-of-text id. Needs data with one
    (the "bpe" tokeniser, a tokenizer.json with an end-of-text token, or .bin files whose sidecar
    names an eos_id): preparing data without it is a ValueError."""

    val_fraction: float = 0.02
    """Fraction of the token stream held out for validation (its tail; with several files, the tail
    of each file)."""

    cache_dir: str | None = None
    """Where corpora, tokenisers and token files are cached; None = $MOETRAIN_CACHE or ~/.cache/moetrain."""

    def __post_init__(self) -> None:
        require(isinstance(self.corpus, str) and self.corpus != "", "data.corpus", self.corpus,
                'must be a registered corpus name or "path"')
        require(self.tokenizer in TOKENIZER_KINDS or (isinstance(self.tokenizer, str)
                                                      and self.tokenizer.endswith(".json")),
                "data.tokenizer", self.tokenizer,
                "must be 'bpe', 'bytes' or the path of a Hugging Face tokenizer.json (ending in .json)")
        require(_is_int(self.vocab_size) and self.vocab_size >= 257, "data.vocab_size",
                self.vocab_size, "must be an int >= 257 (256 byte tokens + end-of-text)")
        require(_is_int(self.seq_len) and self.seq_len >= 1, "data.seq_len", self.seq_len,
                "must be an int >= 1")
        require(isinstance(self.document_mask, bool), "data.document_mask", self.document_mask,
                "must be true or false")
        fraction = self.val_fraction
        require(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction < 0.5,
                "data.val_fraction", fraction, "must be in (0, 0.5)")
        if self.sources is not None:
            self.sources = _checked_sources(self.sources)
            require(self.corpus == "path", "data.sources", [s.path for s in self.sources],
                    f'needs data.corpus="path" (it is {self.corpus!r}): a registered corpus and user '
                    "sources are not mixed")
            require(self.path is None, "data.path", self.path,
                    "must be null when data.sources is set (one source: a single entry in data.sources)")
        require(self.corpus != "path" or self.path is not None or self.sources is not None, "data.path",
                self.path, 'must be set when data.corpus is "path" (or data.sources instead)')
        # A path a registered corpus would ignore: the run would train on that corpus instead.
        require_active(self.corpus == "path" or self.path is None, "data.path", self.path,
                       f'acts only with data.corpus="path" (it is {self.corpus!r}, whose data would be trained '
                       "on instead): pass --data.corpus=path to train on it")


def _checked_sources(sources) -> tuple[DataSource, ...]:
    """``sources`` as a tuple of `DataSource` (mappings accepted), each path and weight checked."""
    require(isinstance(sources, (list, tuple)) and len(sources) > 0, "data.sources", sources,
            "must be a non-empty list of {path, weight}, or null")
    names = [f.name for f in fields(DataSource)]
    out = []
    for i, source in enumerate(sources):
        field = f"data.sources[{i}]"
        if isinstance(source, Mapping):
            unknown = sorted(set(source) - set(names))
            require(not unknown, field, dict(source), f"has unknown keys {unknown}; valid keys: {', '.join(names)}")
            source = DataSource(**source)
        require(isinstance(source, DataSource), field, source, "must be a mapping {path, weight}")
        require(isinstance(source.path, str) and source.path != "", f"{field}.path", source.path,
                "must be a non-empty string")
        weight = source.weight
        require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
                and weight > 0, f"{field}.weight", weight, "must be a finite number > 0")
        out.append(source)
    paths = [s.path for s in out]
    duplicates = sorted({p for p in paths if paths.count(p) > 1})
    require(not duplicates, "data.sources", paths, f"lists {duplicates} more than once: give one entry its "
            "total weight")
    return tuple(out)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
