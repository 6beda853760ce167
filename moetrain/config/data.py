"""Config of the training data: corpus, tokeniser and loader."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from moetrain.config.base import require, require_choice


@dataclass
class DataConfig:
    corpus: str = "shakespeare"
    """Registered corpus name (see `moetrain data list`), or "path" to read `data.path`. The name is
    checked by the data layer, which owns the registry (``moetrain.data.registry.check_corpus``)."""

    path: str | None = None
    """User data (with corpus="path"): a folder (or file) of .txt/.jsonl documents (jsonl: a "text"
    field per line), or one pre-tokenised .bin token file with its .bin.json sidecar (see
    moetrain.data.tokens for the format)."""

    tokenizer: str = "bpe"
    """"bpe": byte-level BPE trained on the corpus and cached; "bytes": raw UTF-8 bytes (vocab 256).
    Ignored for .bin data."""

    vocab_size: int = 4096
    """Target vocabulary of the BPE tokeniser, eos included (ignored for "bytes" and .bin data). A
    small corpus may stop short of it: the model must use the prepared data's vocab_size."""

    seq_len: int = 256
    """Tokens per training sequence."""

    val_fraction: float = 0.02
    """Fraction of the token stream held out for validation (its tail)."""

    cache_dir: str | None = None
    """Where corpora, tokenisers and token files are cached; None = $MOETRAIN_CACHE or ~/.cache/moetrain."""

    def __post_init__(self) -> None:
        require(isinstance(self.corpus, str) and self.corpus != "", "data.corpus", self.corpus,
                'must be a registered corpus name or "path"')
        require_choice("data.tokenizer", self.tokenizer, ("bpe", "bytes"))
        require(_is_int(self.vocab_size) and self.vocab_size >= 257, "data.vocab_size",
                self.vocab_size, "must be an int >= 257 (256 byte tokens + end-of-text)")
        require(_is_int(self.seq_len) and self.seq_len >= 1, "data.seq_len", self.seq_len,
                "must be an int >= 1")
        fraction = self.val_fraction
        require(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction < 0.5,
                "data.val_fraction", fraction, "must be in (0, 0.5)")
        require(self.corpus != "path" or self.path is not None, "data.path", self.path,
                'must be set when data.corpus is "path"')
        if self.corpus != "path" and self.path is not None:
            warnings.warn(f"data.path ({self.path!r}) is ignored because data.corpus is {self.corpus!r}, "
                          'not "path"', stacklevel=2)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
