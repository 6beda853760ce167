"""Tokenisers: raw UTF-8 bytes, or a byte-level BPE trained on the corpus with `tokenizers` and cached.

Both have the same small interface (`Tokenizer`): ``encode(str) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``eos_id`` and ``key`` (a string that identifies the exact vocabulary, used to key the
token-file cache).

End of text: the BPE reserves id 0 for ``<|endoftext|>`` (hence data.vocab_size >= 257: 256 byte
tokens + eos), and the token stream puts it after every document. The byte tokeniser has no spare id
(vocab 256), so ``eos_id`` is None and documents are separated by a newline instead.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from moetrain.data.cache import resolve_cache_dir
from moetrain.utils.files import atomic_path

EOS_TOKEN = "<|endoftext|>"


class Tokenizer(Protocol):
    key: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no training, no special tokens."""

    key = "bytes"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # A window cut mid-character decodes with U+FFFD instead of failing.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) wrapping a `tokenizers.Tokenizer`.

    A literal "<|endoftext|>" inside a text is encoded as the eos token, as in GPT-2 training data.
    """

    def __init__(self, tokenizer, *, key: str) -> None:
        self._tokenizer = tokenizer
        self.key = key
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        # Keep special tokens so decode(encode(s)) == s even for a text that contains "<|endoftext|>".
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        with atomic_path(path) as tmp:
            self._tokenizer.save(str(tmp))

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, key: str | None = None) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)), key=key or Path(path).stem)


def train_bpe(documents: Iterable[str], *, vocab_size: int, key: str = "bpe") -> BPETokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (eos + 256 bytes + merges).

    Deterministic: the same documents give the same merges and ids (tested).
    """
    if not (isinstance(vocab_size, int) and vocab_size >= 257):
        raise ValueError(f"data.vocab_size ({vocab_size!r}) must be an int >= 257 (256 bytes + eos)")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # first, so eos is id 0
        # All 256 bytes, even those the corpus lacks, so any text can be encoded later.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    bpe = BPETokenizer(tokenizer, key=key)
    if bpe.vocab_size < vocab_size:
        warnings.warn(f"BPE training stopped at {bpe.vocab_size} tokens < data.vocab_size={vocab_size}: "
                      "the corpus has no more pairs to merge; the model uses the smaller vocabulary",
                      stacklevel=2)
    return bpe


def load_or_train_bpe(documents, *, vocab_size: int, cache_dir: str | os.PathLike | None = None
                      ) -> BPETokenizer:
    """The BPE for ``documents`` (a `Documents`), read from ``tokenizers/`` or trained and cached there.

    The cache key is the documents' content hash plus ``vocab_size``, so changing either retrains.
    """
    key = f"bpe{vocab_size}-{documents.fingerprint[:16]}"
    path = resolve_cache_dir(cache_dir) / "tokenizers" / f"{key}.json"
    if path.is_file():
        return BPETokenizer.from_file(path, key=key)
    tokenizer = train_bpe(documents, vocab_size=vocab_size, key=key)
    tokenizer.save(path)
    return tokenizer


def build_tokenizer(kind: str, documents=None, *, vocab_size: int = 4096,
                    cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Tokeniser by `data.tokenizer` name: "bytes", or "bpe" (needs ``documents`` to train on)."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        if documents is None:
            raise ValueError('data.tokenizer ("bpe") needs the corpus documents to train on')
        return load_or_train_bpe(documents, vocab_size=vocab_size, cache_dir=cache_dir)
    raise ValueError(f"data.tokenizer ({kind!r}) must be one of 'bpe', 'bytes'")
