"""Tokenisers: round trips, deterministic BPE training, and the tokeniser cache."""

import random

import pytest

from moetrain.data import tokenizer as tokenizer_module
from moetrain.data.documents import Documents
from moetrain.data.tokenizer import EOS_TOKEN, ByteTokenizer, build_tokenizer, train_bpe

WORDS = ["thou", "art", "the", "king", "and", "queen", "of", "night", "love", "sword", "hence", "anon", "good",
         "my", "lord", "what", "say", "you", "wherefore", "doth", "fair", "sweet", "ö", "naïve", "戦", "—"]


@pytest.fixture(autouse=True)
def private_default_cache(tmp_path, monkeypatch):
    """Whatever a test leaves in "the default cache" goes to tmp_path, not ~/.cache/moetrain."""
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "default-cache"))


def synthetic_text(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(num_words // 7)]
    return "\n".join(lines) + "\n"


@pytest.fixture
def documents(tmp_path):
    files = []
    for i in range(4):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(synthetic_text(i, 1500), encoding="utf-8")
    return Documents(files, label="synthetic")


SAMPLES = ["", "thou art", "Hello wörld 😀\n\t  trailing  ", "戦 naïve — \r\n x", f"a{EOS_TOKEN}b"]


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text and tok.vocab_size == 256 and tok.eos_id is None


def test_bpe_round_trip_and_eos(documents):
    tok = train_bpe(documents, vocab_size=320)
    assert tok.vocab_size == 320 and tok.eos_id == 0
    for text in SAMPLES + [next(iter(documents))]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode(f"a{EOS_TOKEN}b")[1] == tok.eos_id
    # merges happened: frequent words take fewer tokens than bytes
    assert len(tok.encode("thou art the king")) < len("thou art the king")


def test_bpe_training_is_deterministic(documents):
    a = train_bpe(documents, vocab_size=300)
    b = train_bpe(documents, vocab_size=300)
    assert a._tokenizer.get_vocab() == b._tokenizer.get_vocab()
    text = next(iter(documents))
    assert a.encode(text) == b.encode(text)


def test_bpe_warns_when_the_corpus_cannot_fill_the_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("ab ab ab", encoding="utf-8")
    with pytest.warns(UserWarning, match="stopped at .* < data.vocab_size=4096"):
        tok = train_bpe(Documents([tmp_path / "a.txt"], label="tiny"), vocab_size=4096)
    assert 257 <= tok.vocab_size < 4096


def test_bpe_is_cached_by_corpus_and_vocab(documents, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = build_tokenizer("bpe", documents, vocab_size=300, cache_dir=cache)
    assert (cache / "tokenizers" / f"{first.key}.json").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("trained again instead of reading the cache")

    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    second = build_tokenizer("bpe", documents, vocab_size=300, cache_dir=cache)
    text = next(iter(documents))
    assert second.key == first.key and second.encode(text) == first.encode(text)
    with pytest.raises(AssertionError, match="trained again"):  # another vocab size is another entry
        build_tokenizer("bpe", documents, vocab_size=301, cache_dir=cache)


def test_build_tokenizer_rejects_unknown_kind_and_small_vocab(documents):
    with pytest.raises(ValueError, match=r"data.tokenizer \('wordpiece'\)"):
        build_tokenizer("wordpiece", documents)
    with pytest.raises(ValueError, match=r"data.vocab_size \(256\) must be an int >= 257"):
        train_bpe(documents, vocab_size=256)


# --- a pretrained tokenizer.json (data.tokenizer = its path) ---------------------------------------


def _pretrained_folder(tmp_path, documents, *, bos_post_processor: bool = False):
    """A tokenizer.json as a Hugging Face model folder holds it: a trained BPE with "<s>" added and
    optionally a post-processor that prepends it (as Llama-style tokenizers do)."""
    from tokenizers import processors

    bpe = train_bpe(documents, vocab_size=300)
    hf = bpe._tokenizer
    hf.add_special_tokens(["<s>"])
    if bos_post_processor:
        hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 300)])
    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    hf.save(str(folder / "tokenizer.json"))
    return folder


def test_pretrained_tokenizer_reads_eos_from_its_folder(tmp_path, documents):
    import json

    folder = _pretrained_folder(tmp_path, documents, bos_post_processor=True)
    path = str(folder / "tokenizer.json")
    assert build_tokenizer(path).eos_id is None  # no file names one
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS_TOKEN}}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [0, 5], "vocab_size": 301}))
    tok = build_tokenizer(path)
    assert tok.eos_id == 0 and tok.vocab_size == 301 and tok.key.startswith("hf-")
    text = next(iter(documents))[:200]
    ids = tok.encode(text)
    assert ids[0] != 300 and tok.decode(ids) == text  # no BOS added per document
    assert tok.encode_batch([text, "thou"]) == [ids, tok.encode("thou")]


def test_pretrained_tokenizer_refuses_inconsistent_special_tokens(tmp_path, documents):
    import json

    folder = _pretrained_folder(tmp_path, documents)
    path = str(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    with pytest.raises(ValueError, match="ambiguous: tokenizer_config.json says 300, generation_config.json says 0"):
        build_tokenizer(path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"eos_token \('</s>'\) is not in the vocabulary"):
        build_tokenizer(path)
    (folder / "tokenizer_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 999}))
    with pytest.raises(ValueError, match=r"eos_token_id \(999, from generation_config.json\) must be in \[0, 301\)"):
        build_tokenizer(path)
    with pytest.raises(ValueError, match="must be an existing tokenizer.json"):
        build_tokenizer(str(tmp_path / "nowhere.json"))


def test_pretrained_tokenizer_key_follows_the_file(tmp_path, documents):
    folder = _pretrained_folder(tmp_path, documents)
    first = build_tokenizer(str(folder / "tokenizer.json")).key
    assert build_tokenizer(str(folder / "tokenizer.json")).key == first
    other = _pretrained_folder(tmp_path / "b", documents, bos_post_processor=True)
    assert build_tokenizer(str(other / "tokenizer.json")).key != first


def test_pretrained_tokenizer_key_follows_its_eos(tmp_path, documents):
    """The eos id comes from the files beside tokenizer.json, and the token stream puts it after every
    document: a changed eos must change the key that names the token cache."""
    import json

    from moetrain.data.tokens import load_or_build_tokens

    folder = _pretrained_folder(tmp_path, documents)
    path = str(folder / "tokenizer.json")
    without = build_tokenizer(path)
    tokens_without, _, file_without = load_or_build_tokens(documents, without, cache_dir=tmp_path / "cache")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    with_eos = build_tokenizer(path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    with_other = build_tokenizer(path)
    assert (without.eos_id, with_eos.eos_id, with_other.eos_id) == (None, 0, 300)
    assert len({without.key, with_eos.key, with_other.key}) == 3
    tokens, meta, file = load_or_build_tokens(documents, with_eos, cache_dir=tmp_path / "cache")
    assert file != file_without and meta["eos_id"] == 0
    assert (tokens == 0).sum() == len(list(documents)) and (tokens_without == 0).sum() == 0
