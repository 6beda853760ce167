"""Training data: corpora registry and cache, tokenisers, token files, rank-sharded resumable loader.

The trainer's path::

    data = prepare_data(cfg.data)                     # fetch + tokenise once, then cache hits
    train = data.train_loader(global_batch_size=G, dp_rank=r, dp_size=n, seed=seed)
    val = data.val_loader(global_batch_size=G, dp_rank=r, dp_size=n)
    input_ids_BS, labels_BS = train.next_batch()

Names are resolved lazily (PEP 562) so that ``moetrain.config`` can consult the registry without
importing torch, numpy or tokenizers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "moetrain.data.cache": ("CorpusIntegrityError", "CorpusUnavailableError", "cached_corpus_files",
                            "fetch_corpus", "is_cached", "resolve_cache_dir"),
    "moetrain.data.documents": ("Documents", "scan_user_path"),
    "moetrain.data.loader": ("TokenLoader",),
    "moetrain.data.prepare": ("PreparedData", "load_documents", "prepare_data", "split_tokens"),
    "moetrain.data.registry": ("CORPORA", "Corpus", "get_corpus", "list_corpora"),
    "moetrain.data.tokenizer": ("BPETokenizer", "ByteTokenizer", "Tokenizer", "build_tokenizer", "train_bpe"),
    "moetrain.data.tokens": ("open_token_file", "token_dtype", "write_token_file"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)  # noqa: PLE0605 (a list, built from _EXPORTS)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'moetrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
