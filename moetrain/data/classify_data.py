"""From a `DataConfig` + `ClassifyConfig` to encoded, padded train/val/test splits and their loaders.

    data = prepare_labelled(cfg.data, cfg.classify)      # read + split, tokenise (cached), pad
    train = data.train_loader(global_batch_size=G, micro_steps=A, dp_rank=r, dp_size=n, seed=seed)
    for input_ids_BS, labels_B, padding_mask_BS, valid_B in data.eval_batches("val", batch_size=B, ...): ...

Each example becomes its first ``S - 1`` tokens plus the end token (the BPE's end-of-text, the
character tokeniser's ``<end>``; the byte tokeniser has none and keeps ``S`` bytes), right-padded to
``S = data.seq_len`` with the pad id; ``length_stats`` records how many examples were cut.

Idempotent and safe on every rank at once like ``prepare_data``: the tokeniser and the encoded splits
(``labelled/<key>.npz``, keyed by the examples' content, the tokeniser and S) are written atomically.

``prepare_labelled_lm`` is the same data for pretraining a language model (``model.head = "lm"`` on a
labelled corpus): the train split's texts as one token stream, tokenised by the very tokeniser a
classifier with the same ``data`` and ``classify`` sections builds, so the classifier can start from
the pretrained export (``checkpoint.init_from``) with the same token ids.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.config.classify import ClassifyConfig
from moetrain.config.data import DataConfig
from moetrain.data.cache import resolve_cache_dir
from moetrain.data.char_tokenizer import CharTokenizer, train_char_tokenizer
from moetrain.data.classify_loader import ClassificationLoader, EncodedSplit, eval_batches
from moetrain.data.documents import document_separator
from moetrain.data.labelled import Examples, LabelledSplits, load_splits
from moetrain.data.prepare import PreparedData
from moetrain.data.tokenizer import ByteTokenizer, Tokenizer, load_or_train_bpe
from moetrain.data.tokens import encode_texts, open_or_build_token_file, token_dtype, write_token_file
from moetrain.utils.files import atomic_path

SPLITS = ("train", "val", "test")
CACHE_FORMAT = 1


@dataclass
class PreparedLabelled:
    """Encoded splits of a labelled data set, ready to be batched."""

    splits: dict[str, EncodedSplit]
    """"train", "val", "test"."""
    classes: list[str]
    """Class names; class id = index."""
    vocab_size: int
    tokenizer: Tokenizer
    seq_len: int
    length_stats: dict
    """Tokens per train example before truncation: percentiles and the fraction cut at ``seq_len``."""

    def train_loader(self, *, global_batch_size: int, micro_steps: int = 1, dp_rank: int = 0, dp_size: int = 1,
                     seed: int = 0, balanced: bool = False, token_dropout: float = 0.0) -> ClassificationLoader:
        return ClassificationLoader(self.splits["train"], global_batch_size=global_batch_size, micro_steps=micro_steps,
                                    dp_rank=dp_rank, dp_size=dp_size, seed=seed, balanced=balanced,
                                    num_classes=len(self.classes), token_dropout=token_dropout)

    def eval_batches(self, split: str, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        """Every example of ``split`` once over the ranks (see ``classify_loader.eval_batches``)."""
        return eval_batches(self.splits[split], batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size)


class _TrainTexts:
    """The train texts as the `Documents` interface ``load_or_train_bpe`` reads (iterable + fingerprint)."""

    def __init__(self, texts: list[str], fingerprint: str) -> None:
        self.texts, self.fingerprint = texts, fingerprint

    def __iter__(self):
        return iter(self.texts)


def _fingerprint(*parts: Examples | list[str]) -> str:
    digest = hashlib.sha256(b"moetrain-labelled-v1")
    for part in parts:
        items = (part.labels + part.texts) if isinstance(part, Examples) else part
        for item in items:
            data = item.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
        digest.update(b"|")
    return digest.hexdigest()


def build_classify_tokenizer(splits: LabelledSplits, data: DataConfig, cfg: ClassifyConfig) -> Tokenizer:
    """The tokeniser ``classify.tokenizer`` names, trained on the train split only and cached."""
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    texts = splits.train.texts
    train_key = _fingerprint(texts)
    if cfg.tokenizer == "bpe":
        return load_or_train_bpe(_TrainTexts(texts, train_key), vocab_size=data.vocab_size, cache_dir=data.cache_dir)
    path = resolve_cache_dir(data.cache_dir) / "tokenizers" / f"char{cfg.min_char_count}-{train_key[:16]}.json"
    if path.is_file():
        return CharTokenizer.from_file(path)
    tokenizer = train_char_tokenizer(texts, min_count=cfg.min_char_count)
    tokenizer.save(path)
    return tokenizer


def _end_and_pad(tokenizer: Tokenizer) -> tuple[int | None, int]:
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.eos_id, tokenizer.pad_id
    # BPE: end-of-text ends every example and pads it (padding never reaches a real token). Bytes: no
    # spare id; pad with 0, which the padding mask hides.
    return tokenizer.eos_id, tokenizer.eos_id if tokenizer.eos_id is not None else 0


def encode_split(examples: Examples, label_ids_N: np.ndarray, tokenizer: Tokenizer, *, seq_len: int
                 ) -> tuple[EncodedSplit, np.ndarray]:
    """(the padded split, tokens per example before truncation [N], end token excluded)."""
    end_id, pad_id = _end_and_pad(tokenizer)
    keep = seq_len - (end_id is not None)
    ids_NS = np.full((len(examples), seq_len), pad_id, dtype=np.int32)
    lengths_N = np.empty(len(examples), dtype=np.int32)
    raw_N = np.empty(len(examples), dtype=np.int64)
    for n, ids in enumerate(tokenizer.encode_batch(examples.texts)):
        raw_N[n] = len(ids)
        ids = ids[:keep] + ([end_id] if end_id is not None else [])
        ids_NS[n, :len(ids)] = ids
        lengths_N[n] = max(len(ids), 1)  # an example that encodes to nothing keeps one pad token
    return EncodedSplit(ids_NS=ids_NS, lengths_N=lengths_N, labels_N=label_ids_N, pad_id=pad_id,
                        ends_with_end_token=end_id is not None), raw_N


def length_stats(raw_N: np.ndarray, *, seq_len: int, reserved: int) -> dict:
    p50, p90, p99, p100 = np.percentile(raw_N, [50, 90, 99, 100])
    return {"tokens_p50": float(p50), "tokens_p90": float(p90), "tokens_p99": float(p99), "tokens_max": int(p100),
            "truncated_fraction": float(np.mean(raw_N > seq_len - reserved)), "seq_len": seq_len}


def prepare_labelled(data: DataConfig, cfg: ClassifyConfig, *, download: bool = True) -> PreparedLabelled:
    """Read, split, tokenise and pad the labelled data of ``data`` (see the module docstring)."""
    splits = load_splits(data, cfg, download=download)
    tokenizer = build_classify_tokenizer(splits, data, cfg)
    label_ids = {name: splits.label_ids(name) for name in SPLITS}  # unknown labels fail here, by line
    end_id, pad_id = _end_and_pad(tokenizer)
    # The cache holds class ids: the class order is part of what they mean.
    key = _fingerprint(splits.train, splits.val, splits.test, [tokenizer.key, str(data.seq_len)],
                       splits.classes)[:24]
    path = resolve_cache_dir(data.cache_dir) / "labelled" / f"{key}.npz"
    cached = _read_cache(path)
    if cached is not None:
        encoded, stats = cached
    else:
        encoded, raw = {}, {}
        for name in SPLITS:
            encoded[name], raw[name] = encode_split(getattr(splits, name), label_ids[name], tokenizer,
                                                    seq_len=data.seq_len)
        stats = length_stats(raw["train"], seq_len=data.seq_len, reserved=int(end_id is not None))
        _write_cache(path, encoded, stats)
    for split in encoded.values():  # not in the cache file: they follow from the tokenizer
        split.pad_id, split.ends_with_end_token = pad_id, end_id is not None
    return PreparedLabelled(splits=encoded, classes=splits.classes, vocab_size=tokenizer.vocab_size,
                            tokenizer=tokenizer, seq_len=data.seq_len, length_stats=stats)


def prepare_labelled_lm(data: DataConfig, cfg: ClassifyConfig, *, download: bool = True) -> PreparedData:
    """Language-model data from a labelled corpus: training stream = the train split's texts (the
    validation carve-out and the test split excluded), each followed by the end-of-text id (a newline
    for the byte tokeniser); validation stream = the validation split's texts. The tokeniser is
    ``build_classify_tokenizer``'s (trained on the train split, cached), so token ids agree with a
    classifier's of the same ``data``/``classify`` sections. Packed into ``data.seq_len`` windows
    like any corpus; ``data.document_mask`` keeps attention within each example. Cached under
    ``labelled/lm-<key>-{train,val}.bin``."""
    if data.tokenizer != "bpe":
        warnings.warn(f"data.tokenizer ({data.tokenizer!r}) is ignored for a language model on the labelled corpus "
                      f"{data.corpus!r}: classify.tokenizer ({cfg.tokenizer!r}) names its tokenizer, the "
                      "classifier's", stacklevel=2)
    splits = load_splits(data, cfg, download=download)
    tokenizer = build_classify_tokenizer(splits, data, cfg)
    key = _fingerprint(splits.train, splits.val, [tokenizer.key])[:24]
    folder = resolve_cache_dir(data.cache_dir) / "labelled"
    streams = {}
    for name in ("train", "val"):
        path, texts = folder / f"lm-{key}-{name}.bin", getattr(splits, name).texts

        def build(path=path, texts=texts) -> None:
            tokens, _ = encode_texts(texts, tokenizer, token_dtype(tokenizer.vocab_size))
            write_token_file(path, [tokens], vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                             tokenizer=tokenizer.key)

        streams[name] = open_or_build_token_file(path, build)[0]
    separator = document_separator(data.document_mask, tokenizer.eos_id, what=f"corpus {data.corpus!r}")
    return PreparedData(train_tokens=streams["train"], val_tokens=streams["val"], vocab_size=tokenizer.vocab_size,
                        eos_id=tokenizer.eos_id, tokenizer=tokenizer, seq_len=data.seq_len,
                        token_file=folder / f"lm-{key}-train.bin", document_separator=separator)


def _write_cache(path: Path, encoded: dict[str, EncodedSplit], stats: dict) -> None:
    arrays = {f"{name}_{field}": getattr(split, field) for name, split in encoded.items()
              for field in ("ids_NS", "lengths_N", "labels_N")}
    meta = json.dumps({"format": CACHE_FORMAT, "length_stats": stats})
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, meta=np.array(meta), **arrays)


def _read_cache(path: Path) -> tuple[dict[str, EncodedSplit], dict] | None:
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != CACHE_FORMAT:
                return None
            encoded = {name: EncodedSplit(*(z[f"{name}_{field}"] for field in ("ids_NS", "lengths_N", "labels_N")))
                       for name in SPLITS}
    except (OSError, ValueError, KeyError):
        return None  # absent or written by another format: rebuild
    return encoded, meta["length_stats"]
