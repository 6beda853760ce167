"""Tokenisers: raw UTF-8 bytes, a byte-level BPE trained on the corpus with `tokenizers` and cached,
or a pretrained model's own ``tokenizer.json`` (``data.tokenizer`` = its path), read with `tokenizers`.

Both have the same small interface (`Tokenizer`): ``encode(str) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``eos_id`` and ``key`` (a string that identifies the exact vocabulary, used to key the
token-file cache).

End of text: the BPE reserves id 0 for ``<|endoftext|>`` (hence data.vocab_size >= 257: 256 byte
tokens + eos), and the token stream puts it after every document. The byte tokeniser has no spare id
(vocab 256), so ``eos_id`` is None and documents are separated by a newline instead. A pretrained
``tokenizer.json`` takes its end-of-text token from the files beside it, as ``transformers`` does
(``PretrainedTokenizer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from moetrain.data.cache import resolve_cache_dir
from moetrain.utils.files import atomic_path

EOS_TOKEN = "<|endoftext|>"


class Tokenizer(Protocol):
    # Read-only: a tokenizer may hold these as class constants (ByteTokenizer's eos_id is always None).
    @property
    def key(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

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
        return [e.ids for e in _batch_encoder(self._tokenizer)(list(texts))]

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


def _batch_encoder(tokenizer):
    """``encode_batch_fast`` where the library has it (tokenizers >= 0.20): the same ids without the
    character offsets, which nothing here reads (about 7% less CPU per token)."""
    return getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)


class PretrainedTokenizer(BPETokenizer):
    """A Hugging Face ``tokenizer.json`` (any model the `tokenizers` library reads: byte-level BPE,
    SentencePiece-style BPE, ...); plain JSON, no code runs.

    ``vocab_size`` counts the added special tokens. The end-of-text id comes from the folder of
    the file: ``tokenizer_config.json``'s ``eos_token``, else ``generation_config.json``'s, else
    ``config.json``'s ``eos_token_id`` (the first of a list); where several name one they must
    agree, and it must be in the vocabulary (ValueError naming the file otherwise). None when no
    file names one. Texts are encoded without the post-processor's special tokens (no BOS per
    document): the token stream separates documents with eos. ``key`` is a hash of the file plus
    the eos id, so the token cache follows the exact vocabulary and end-of-text token.
    """

    def __init__(self, tokenizer, *, key: str, eos_id: int | None, path: Path) -> None:
        super().__init__(tokenizer, key=key)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in _batch_encoder(self._tokenizer)(list(texts), add_special_tokens=False)]

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, key: str | None = None) -> PretrainedTokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"data.tokenizer ({str(path)!r}) must be an existing tokenizer.json")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception type for a malformed file
            raise ValueError(f"data.tokenizer ({str(path)!r}) is not a tokenizer.json the tokenizers library reads: "
                             f"{e}") from e
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        eos_id = _pretrained_eos_id(tokenizer, path)
        # The eos comes from the files beside tokenizer.json and goes after every document of the token
        # stream: the same file with another eos must not share a token cache entry.
        key = key or f"hf-{digest}-eos{'none' if eos_id is None else eos_id}"
        return cls(tokenizer, key=key, eos_id=eos_id, path=path)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _pretrained_eos_id(tokenizer, path: Path) -> int | None:
    """The end-of-text id of a tokenizer.json from the files beside it (see PretrainedTokenizer)."""
    found: dict[str, int] = {}
    for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
        file = path.parent / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except ValueError as e:
            raise ValueError(f"{str(file)!r} is not JSON: {e}") from e
        if name == "tokenizer_config.json":
            text = _token_text(data.get("eos_token"))
            if text is None:
                continue
            eos = tokenizer.token_to_id(text)
            if eos is None:
                raise ValueError(f"{str(file)!r} eos_token ({text!r}) is not in the vocabulary of {str(path)!r}")
        else:
            eos = _first_id(data.get("eos_token_id"))
            if eos is None:
                continue
        found[name] = eos
    if len(set(found.values())) > 1:
        raise ValueError(f"the end-of-text token of {str(path)!r} is ambiguous: "
                         + ", ".join(f"{n} says {i}" for n, i in found.items()))
    eos = next(iter(found.values()), None)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if eos is not None and not 0 <= eos < vocab:
        raise ValueError(f"eos_token_id ({eos}, from {next(iter(found))}) must be in [0, {vocab}): the vocabulary "
                         f"of {str(path)!r}")
    return eos


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
    """Tokeniser by `data.tokenizer` name: "bytes", "bpe" (needs ``documents`` to train on), or the
    path of a pretrained ``tokenizer.json`` (ends in ".json")."""
    if kind.endswith(".json"):
        return PretrainedTokenizer.from_file(kind)
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        if documents is None:
            raise ValueError('data.tokenizer ("bpe") needs the corpus documents to train on')
        return load_or_train_bpe(documents, vocab_size=vocab_size, cache_dir=cache_dir)
    raise ValueError(f"data.tokenizer ({kind!r}) must be one of 'bpe', 'bytes' or the path of a tokenizer.json")


SAVED_TOKENIZER = "tokenizer.json"
"""The tokenizer a run trained with, in its run folder and in its exports (``save_tokenizer``)."""

_SIBLING_FILES = ("special_tokens_map.json", "generation_config.json")
"""Files of a pretrained tokenizer's folder copied with it (tokenizer_config.json is written)."""


def save_tokenizer(tokenizer: Tokenizer | None, folder: str | os.PathLike, *, durable: bool = False) -> list[str]:
    """Write ``tokenizer`` into ``folder`` so that ``load_saved_tokenizer(folder)`` gives the same ids,
    ``vocab_size``, ``eos_id`` and decode without the corpus; the names of the files written.

    A BPE (trained or pretrained) is its ``tokenizer.json`` beside a ``tokenizer_config.json`` that
    names its end-of-text token, where ``PretrainedTokenizer`` (and Hugging Face's AutoTokenizer)
    read it: a pretrained tokenizer whose eos came from a config.json not copied here keeps it.
    The byte tokenizer is rebuilt from its name and pre-tokenised data has none: nothing is
    written, and a tokenizer.json left by an earlier run in ``folder`` is removed so that it is
    not read as this run's. tokenizer.json is written last: a folder with one is complete.
    """
    folder = Path(folder)
    target = folder / SAVED_TOKENIZER
    if not isinstance(tokenizer, BPETokenizer):
        target.unlink(missing_ok=True)
        return []
    source = tokenizer.path if isinstance(tokenizer, PretrainedTokenizer) else None
    if source is not None and source.resolve() == target.resolve():
        return []  # the run trains with the tokenizer of its own folder: already in place
    raw, config = None, {"tokenizer_class": "PreTrainedTokenizerFast"}
    if source is not None and (source.parent / "tokenizer_config.json").is_file():
        raw = (source.parent / "tokenizer_config.json").read_bytes()
        config = json.loads(raw)
    if tokenizer.eos_id is not None and _token_text(config.get("eos_token")) is None:
        config["eos_token"] = tokenizer._tokenizer.id_to_token(tokenizer.eos_id)
        raw = None
    with atomic_path(folder / "tokenizer_config.json", durable=durable) as tmp:
        # The original's bytes where it already names the eos (a Hugging Face folder stays as it was).
        tmp.write_bytes(raw if raw is not None else (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode())
    written = ["tokenizer_config.json"]
    for name in _SIBLING_FILES:
        if source is not None and (source.parent / name).is_file():
            with atomic_path(folder / name, durable=durable) as tmp:
                tmp.write_bytes((source.parent / name).read_bytes())
            written.append(name)
        else:  # a stale one could name another eos_token_id than tokenizer_config.json
            (folder / name).unlink(missing_ok=True)
    with atomic_path(target, durable=durable) as tmp:
        if source is None:
            tokenizer._tokenizer.save(str(tmp))
        else:
            tmp.write_bytes(source.read_bytes())  # the same bytes: the same key (token cache) as the original
    return [SAVED_TOKENIZER, *written]


def load_saved_tokenizer(folder: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer ``save_tokenizer`` wrote into ``folder``; None when there is none."""
    path = Path(folder) / SAVED_TOKENIZER
    return PretrainedTokenizer.from_file(path) if path.is_file() else None
