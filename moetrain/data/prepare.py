"""From a `DataConfig` to memory-mapped train/val token streams and their loaders.

One stream (a registered corpus, a text folder or one .bin file in ``data.path``) gives a
`PreparedData` batched by `TokenLoader`; several sources (``data.sources``, or a ``data.path``
folder of several .bin shards) give a `MixedData` batched by `MixtureLoader`
(moetrain.data.sources). Both have the same interface: ``train_loader``, ``val_loader``,
``vocab_size``, ``eos_id``, ``tokenizer``, ``seq_len`` and ``document_separator``.

``prepare_data`` is idempotent and safe to call from every rank at once (all cache writes are atomic
renames), but only the first call does work: fetch the corpus, train the BPE, tokenise. A trainer that
wants that work done once calls it on rank 0, barriers, then calls it everywhere (pure cache hits).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.config.data import DataConfig, DataSource
from moetrain.data.cache import cached_corpus_files, fetch_corpus
from moetrain.data.documents import Documents, document_separator, scan_user_path
from moetrain.data.loader import TokenLoader
from moetrain.data.megatron import is_megatron
from moetrain.data.registry import check_corpus
from moetrain.data.sources import MixedData, prepare_sources
from moetrain.data.tokenizer import Tokenizer, build_tokenizer
from moetrain.data.tokens import load_or_build_tokens, open_token_file, split_tokens


@dataclass
class PreparedData:
    """The token stream of `data`, split into train and val, ready to be batched."""

    train_tokens: np.ndarray
    """Train part of the stream [N_train] (a read-only memmap view)."""

    val_tokens: np.ndarray
    """Val part: the last `val_fraction` of the stream [N_val]; disjoint from train."""

    vocab_size: int
    """Ids are in [0, vocab_size): the model's embedding must be at least this big."""

    eos_id: int | None
    """End-of-text id placed after each document, or None (byte tokeniser, some .bin files)."""

    tokenizer: Tokenizer | None
    """For encode/decode (sampling, reports); None for pre-tokenised .bin data."""

    seq_len: int
    token_file: Path
    """The memory-mapped file behind both splits."""

    document_separator: int | None = None
    """``model.document_separator`` for ``data.document_mask``: the eos id, or None (mask off)."""

    def train_loader(self, *, global_batch_size: int, micro_steps: int = 1, dp_rank: int = 0, dp_size: int = 1,
                     seed: int = 0) -> TokenLoader:
        """Shuffled, endless, resumable micro-batches of this rank's share of each global batch."""
        return TokenLoader(self.train_tokens, seq_len=self.seq_len, global_batch_size=global_batch_size,
                           micro_steps=micro_steps, dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=True,
                           name="train")

    def val_loader(self, *, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> TokenLoader:
        """Val windows in stream order; evaluate with ``loader.eval_batches(max_windows)``."""
        return TokenLoader(self.val_tokens, seq_len=self.seq_len, global_batch_size=global_batch_size,
                           dp_rank=dp_rank, dp_size=dp_size, shuffle=False, name="val")


def load_documents(cfg: DataConfig, *, download: bool = True) -> Documents:
    """The text documents of `cfg`: a registered corpus (fetched unless cached) or a text folder.

    With ``download=False`` a corpus that is not cached raises instead of running pip.
    """
    check_corpus(cfg.corpus)
    if cfg.corpus == "path":
        kind, files = scan_user_path(_user_path(cfg))
        if kind != "text":
            raise ValueError(f"data.path ({cfg.path!r}) holds pre-tokenised .bin data, not documents")
        return Documents(files, label=f"data.path {cfg.path!r}")
    if download:
        fetch_corpus(cfg.corpus, cfg.cache_dir)  # returns at once, without network, when cached
    return Documents(cached_corpus_files(cfg.corpus, cfg.cache_dir), label=f"corpus {cfg.corpus!r}")


def prepare_data(cfg: DataConfig, *, download: bool = True) -> PreparedData | MixedData:
    """Fetch, tokenise (cached) and split the data of `cfg`; see the module docstring."""
    check_corpus(cfg.corpus)  # before any work, whichever kind of data follows
    if cfg.sources is not None:
        return prepare_sources(cfg, list(cfg.sources))
    kind, files = scan_user_path(_user_path(cfg)) if cfg.corpus == "path" else ("corpus", [])
    if kind == "tokens" and (len(files) > 1 or is_megatron(files[0])):  # shards, or a vocabulary to check
        return prepare_sources(cfg, [DataSource(path=_user_path(cfg))], field="data.path")
    if kind == "tokens":
        token_file = files[0]
        tokens, meta = open_token_file(token_file)
        warnings.warn(f"data.tokenizer ({cfg.tokenizer!r}) and data.vocab_size ({cfg.vocab_size}) are "
                      f"ignored for pre-tokenised data: vocab_size={meta['vocab_size']} comes from "
                      f"{token_file.name}.json", stacklevel=2)
        tokenizer, vocab_size, eos_id = None, meta["vocab_size"], meta.get("eos_id")
    else:
        documents = load_documents(cfg, download=download)
        tokenizer = build_tokenizer(cfg.tokenizer, documents, vocab_size=cfg.vocab_size,
                                    cache_dir=cfg.cache_dir)
        tokens, meta, token_file = load_or_build_tokens(documents, tokenizer, cache_dir=cfg.cache_dir)
        vocab_size, eos_id = tokenizer.vocab_size, tokenizer.eos_id
    separator = document_separator(cfg.document_mask, eos_id,
                                   what=f"data.path {cfg.path!r}" if cfg.corpus == "path" else f"corpus {cfg.corpus!r}")
    train_tokens, val_tokens = split_tokens(tokens, cfg.val_fraction)
    return PreparedData(train_tokens=train_tokens, val_tokens=val_tokens, vocab_size=vocab_size,
                        eos_id=eos_id, tokenizer=tokenizer, seq_len=cfg.seq_len, token_file=Path(token_file),
                        document_separator=separator)


def _user_path(cfg: DataConfig) -> str:
    assert cfg.path is not None, "DataConfig requires data.path with corpus 'path' when data.sources is unset"
    return cfg.path
