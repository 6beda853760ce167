"""Training data: corpora registry and cache, tokenisers, token files, rank-sharded resumable loader.

The trainer's path::

    data = prepare_data(cfg.data)                     # fetch + tokenise once, then cache hits
    train = data.train_loader(global_batch_size=G, micro_steps=A, dp_rank=r, dp_size=n, seed=seed)
    val = data.val_loader(global_batch_size=B * n, dp_rank=r, dp_size=n)
    input_ids_BS, labels_BS = train.next_batch()
"""

from moetrain.data.cache import (
    CorpusIntegrityError,
    CorpusUnavailableError,
    cached_corpus_files,
    fetch_corpus,
    is_cached,
    resolve_cache_dir,
)
from moetrain.data.documents import Documents, scan_user_path
from moetrain.data.loader import TokenLoader
from moetrain.data.prepare import PreparedData, load_documents, prepare_data, split_tokens
from moetrain.data.registry import CORPORA, Corpus, check_corpus, get_corpus, list_corpora
from moetrain.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, build_tokenizer, train_bpe
from moetrain.data.tokens import open_token_file, token_dtype, write_token_file

__all__ = [
    "CORPORA",
    "BPETokenizer",
    "ByteTokenizer",
    "Corpus",
    "CorpusIntegrityError",
    "CorpusUnavailableError",
    "Documents",
    "PreparedData",
    "TokenLoader",
    "Tokenizer",
    "build_tokenizer",
    "cached_corpus_files",
    "check_corpus",
    "fetch_corpus",
    "get_corpus",
    "is_cached",
    "list_corpora",
    "load_documents",
    "open_token_file",
    "prepare_data",
    "resolve_cache_dir",
    "scan_user_path",
    "split_tokens",
    "token_dtype",
    "train_bpe",
    "write_token_file",
]
