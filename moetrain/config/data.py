"""Config of the training data: corpus, tokeniser and loader."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.base import require, require_choice, require_positive


@dataclass
class DataConfig:
    corpus: str = "shakespeare"
    """Registered corpus name (see `moetrain data list`), or "path" to read `data.path`."""

    path: str | None = None
    """User data: a folder of .txt/.jsonl files or pre-tokenised .bin token files."""

    tokenizer: str = "bpe"
    """"bpe": byte-level BPE trained on the corpus and cached; "bytes": raw UTF-8 bytes (vocab 256)."""

    vocab_size: int = 4096
    """Target vocabulary of the BPE tokeniser (ignored for "bytes")."""

    seq_len: int = 256
    """Tokens per training sequence."""

    val_fraction: float = 0.02
    """Fraction of the corpus held out for validation."""

    cache_dir: str | None = None
    """Where corpora and tokenisers are cached; None = $MOETRAIN_CACHE or ~/.cache/moetrain."""

    def __post_init__(self) -> None:
        require_choice("data.tokenizer", self.tokenizer, ("bpe", "bytes"))
        require(isinstance(self.vocab_size, int) and self.vocab_size >= 257, "data.vocab_size",
                self.vocab_size, "must be an int >= 257")
        require_positive("data.seq_len", self.seq_len)
        require(0 < self.val_fraction < 0.5, "data.val_fraction", self.val_fraction, "must be in (0, 0.5)")
        require(self.corpus != "path" or self.path is not None, "data.path", self.path,
                'must be set when data.corpus is "path"')
