"""Megatron-LM's indexed dataset (.bin + .idx): moetrain's reader and writer against megatron-core's
own IndexedDatasetBuilder and IndexedDataset (the dev extra), and such a corpus as a data source."""

import json
import warnings

import numpy as np
import pytest
import torch

from moetrain.config.data import DataConfig
from moetrain.data.megatron import open_megatron, write_index
from moetrain.data.prepare import prepare_data
from moetrain.data.prepare_corpus import PrepareOptions, prepare_corpus
from moetrain.data.tokenizer import EOS_TOKEN, train_bpe

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns about optional GPU packages on import
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def random_documents(rng, num_documents, vocab_size):
    """Documents of 1-3 sequences (as with --split-sentences) of random ids."""
    return [[rng.integers(0, vocab_size, rng.integers(1, 30)) for _ in range(rng.integers(1, 4))]
            for _ in range(num_documents)]


@pytest.mark.parametrize(("dtype", "vocab_size"), [(np.uint16, 50_000), (np.int32, 100_000)])
def test_moetrain_reads_what_megatron_core_writes(tmp_path, dtype, vocab_size):
    docs = random_documents(np.random.default_rng(0), 25, vocab_size)
    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for sequence in doc:
            builder.add_item(torch.from_numpy(sequence.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")

    reference = IndexedDataset(prefix)
    tokens, index = open_megatron(prefix + ".bin")
    assert tokens.dtype == dtype and isinstance(tokens, np.memmap)
    assert np.array_equal(tokens, np.concatenate([reference[i] for i in range(len(reference))]))
    assert np.array_equal(index.sequence_lengths, reference.sequence_lengths)
    assert np.array_equal(index.document_indices, reference.document_indices)
    assert np.array_equal(tokens, np.concatenate([s for d in docs for s in d]))


def test_megatron_core_reads_what_moetrain_writes(tmp_path):
    docs = random_documents(np.random.default_rng(1), 20, 300)
    sequences = [s.astype(np.uint16) for d in docs for s in d]
    documents = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    np.concatenate(sequences).tofile(tmp_path / "x.bin")
    write_index(tmp_path / "x.idx", dtype=np.uint16, sequence_lengths=[len(s) for s in sequences],
                document_indices=documents)
    reference = IndexedDataset(str(tmp_path / "x"))
    assert len(reference) == len(sequences)
    assert all(np.array_equal(reference[i], s) for i, s in enumerate(sequences))
    assert np.array_equal(reference.document_indices, documents)
    assert np.array_equal(reference.get(3, offset=1, length=2), sequences[3][1:3])


def test_prepare_format_megatron_reads_in_megatron_core_and_trains(tmp_path):
    rng = np.random.default_rng(2)
    words = np.array("a king the queen of night sword love".split())
    texts = [" ".join(rng.choice(words, rng.integers(2, 20))) for _ in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = tmp_path / "tok"
    tok.mkdir()
    tokenizer = train_bpe(texts, vocab_size=270)
    tokenizer.save(tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    out = tmp_path / "out"
    prepare_corpus([tmp_path / "in.jsonl"], PrepareOptions(out_dir=out, tokenizer=str(tok / "tokenizer.json"),
                                                           num_workers=0, shard_docs=16, output_format="megatron"),
                   log=lambda m: None)
    shards = sorted(out.glob("shard-*.bin"))
    assert len(shards) == 3 and all(p.with_suffix(".idx").is_file() for p in shards)
    # One sequence per document, eos at its end (Megatron's --append-eod).
    # Copies: megatron-core closes its memory map when the dataset object goes.
    readers = [IndexedDataset(str(p.with_suffix(""))) for p in shards]
    sequences = [np.array(r[i]) for r in readers for i in range(len(r))]
    assert [list(s) for s in sequences] == [tokenizer.encode(t) + [tokenizer.eos_id] for t in texts]

    # Trains as data.path=OUT (the sidecars carry the vocabulary) ...
    with pytest.warns(UserWarning, match="ignored for pre-tokenised data: vocab_size=270"):
        data = prepare_data(DataConfig(corpus="path", path=str(out), seq_len=8, val_fraction=0.1, tokenizer="bytes"))
    assert data.vocab_size == 270 and data.eos_id == 0
    # ... and without them (a corpus preprocessed by Megatron-LM) the tokenizer.json supplies it.
    for p in out.glob("*.bin.json"):
        p.unlink()
    with pytest.raises(ValueError, match=r"shard-00000-00000.bin is Megatron-LM indexed data .* set data.tokenizer"):
        prepare_data(DataConfig(corpus="path", path=str(out), seq_len=8, val_fraction=0.1, tokenizer="bytes"))
    data = prepare_data(DataConfig(corpus="path", path=str(out), seq_len=8, val_fraction=0.1,
                                   tokenizer=str(tok / "tokenizer.json")))
    assert data.vocab_size == 270 and data.eos_id == 0
    stream = np.concatenate([np.concatenate([t, v]) for s in data.sources for t, v in zip(s.train, s.val, strict=True)])
    assert np.array_equal(stream, np.concatenate(sequences))


def test_a_damaged_index_is_named(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "x.bin")
    write_index(tmp_path / "x.idx", dtype=np.uint16, sequence_lengths=[4, 6])
    open_megatron(tmp_path / "x.bin")
    (tmp_path / "x.bin").write_bytes(b"\0" * 18)
    with pytest.raises(ValueError, match=r"x.bin has 18 bytes but its index describes 10 uint16 tokens"):
        open_megatron(tmp_path / "x.bin")
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    with pytest.raises(ValueError, match=r"x.idx is not a Megatron index"):
        open_megatron(tmp_path / "x.bin")
