"""moetrain data prepare in process (workers=0): every input kind, the token ids against the
tokeniser applied document by document, shard boundaries, bad input, resuming after a failure, and
the output trained on as ``data.path``. Worker processes and SIGKILL: tests/integration."""

import gzip
import json
import random

import numpy as np
import pytest

from moetrain.config.data import DataConfig
from moetrain.data.inputs import BadInputError, discover_inputs
from moetrain.data.prepare import prepare_data
from moetrain.data.prepare_corpus import PrepareOptions, prepare_corpus
from moetrain.data.tokenizer import EOS_TOKEN, PretrainedTokenizer, train_bpe
from moetrain.data.tokens import open_token_file

WORDS = "thou art the king queen night love sword hence good lord fair sweet doth say".split()


def documents(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def write_jsonl(path, docs, *, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
            if i == 3:
                f.write("\n")  # a blank line is no record


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Five inputs, one of each kind, and the documents in the order a prepare reads them."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root = tmp_path_factory.mktemp("inputs")
    parts = [documents(i, n) for i, n in enumerate([23, 17, 11, 19, 13])]
    write_jsonl(root / "a.jsonl", parts[0])
    write_jsonl(root / "b.jsonl.gz", parts[1], opener=gzip.open)
    write_jsonl(root / "c.jsonl.zst", parts[2], opener=zstandard.open)
    pq.write_table(pa.table({"text": parts[3], "n": list(range(len(parts[3])))}), root / "d.parquet",
                   row_group_size=5)
    datasets.Dataset.from_dict({"body": parts[4]}).save_to_disk(str(root / "e"))
    tok_dir = root / "tok"
    tok_dir.mkdir()
    train_bpe([d for p in parts for d in p], vocab_size=300).save(tok_dir / "tokenizer.json")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]
    return {"root": root, "inputs": [str(root / n) for n in names], "parts": parts,
            "tokenizer": str(tok_dir / "tokenizer.json")}


def options(out, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("shard_docs", 8)
    kw.setdefault("batch_docs", 3)
    return PrepareOptions(out_dir=out, **kw)


def shard_tokens(out) -> list[np.ndarray]:
    return [np.asarray(open_token_file(p)[0]) for p in sorted(out.glob("shard-*.bin"))]


def quiet(message: str) -> None:
    pass


def test_every_input_kind_gives_the_tokeniser_ids_in_input_order(corpus, tmp_path):
    tokenizer = PretrainedTokenizer.from_file(corpus["tokenizer"])
    manifest = prepare_corpus(corpus["inputs"], options(tmp_path / "out", tokenizer=corpus["tokenizer"]), log=quiet)
    arrow = prepare_corpus([corpus["root"] / "e"], options(tmp_path / "arrow", tokenizer=corpus["tokenizer"],
                                                           text_field="body"), log=quiet)
    # The oracle: each document encoded on its own, eos after it, in input order.
    for out, parts in ((tmp_path / "out", corpus["parts"][:4]), (tmp_path / "arrow", corpus["parts"][4:])):
        expected = [i for part in parts for d in part for i in tokenizer.encode(d) + [tokenizer.eos_id]]
        assert np.array_equal(np.concatenate(shard_tokens(out)), expected)
    # Shards cut every 8 records of each input: 23 -> 8, 8, 7 documents, ...
    index = json.loads((tmp_path / "out" / "index.json").read_text())["shards"]
    assert [(s["input"], s["first_record"], s["num_documents"]) for s in index] == \
        [(0, 0, 8), (0, 8, 8), (0, 16, 7), (1, 0, 8), (1, 8, 8), (1, 16, 1), (2, 0, 8), (2, 8, 3),
         (3, 0, 8), (3, 8, 8), (3, 16, 3)]
    assert manifest["num_documents"] == 70 and arrow["num_documents"] == 13 and manifest["num_bad"] == 0
    assert manifest["tokenizer"]["key"] == tokenizer.key and not (tmp_path / "out" / "progress.json").exists()
    from moetrain.data.cache import sha256_file

    assert [i["sha256"] for i in manifest["inputs"]] == [sha256_file(p) for p in corpus["inputs"]]
    assert manifest["tokenizer"]["sha256"] == sha256_file(corpus["tokenizer"])


def test_a_folder_stands_for_its_inputs_in_path_order(corpus):
    found = [(i.path.relative_to(corpus["root"]).as_posix(), i.kind) for i in discover_inputs([corpus["root"]])]
    assert found == [("a.jsonl", "jsonl"), ("b.jsonl.gz", "jsonl.gz"), ("c.jsonl.zst", "jsonl.zst"),
                     ("d.parquet", "parquet"), ("e", "arrow")]  # not e's own .arrow files, nor tok/


def test_bpe_output_trains_as_data_path_with_its_own_tokenizer(corpus, tmp_path):
    out = tmp_path / "out"
    manifest = prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bpe", vocab_size=280), log=quiet)
    data = prepare_data(DataConfig(corpus="path", path=str(out), tokenizer=str(out / "tokenizer.json"),
                                   seq_len=8, val_fraction=0.1))
    assert data.vocab_size == 280 and data.eos_id == 0 and data.tokenizer.key == manifest["tokenizer"]["key"]
    assert sum(len(t) + len(v) for s in data.sources for t, v in zip(s.train, s.val, strict=True)) == \
        manifest["num_tokens"]
    x, y = data.train_loader(global_batch_size=2, seed=0).next_batch()
    assert x.shape == (2, 8)
    # A second run finds the manifest and does nothing.
    again = prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bpe", vocab_size=280), log=quiet)
    assert again == manifest


def test_bad_records_fail_naming_file_and_line_then_resume_with_skip_bad(corpus, tmp_path):
    docs = documents(7, 30)
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": d}) for d in docs]
    lines[20] = '{"text": "cut'  # line 21: not JSON
    lines[25] = '{"title": "no text"}'  # line 26: no text field
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(BadInputError, match=rf"{path}:21 is not valid JSON .*--skip-bad"):
        prepare_corpus([path], options(out, tokenizer="bytes"), log=quiet)
    # The shards finished before the bad line stay: records 0-7 and 8-15.
    kept = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    assert sorted(kept) == ["shard-00000-00000.bin", "shard-00000-00000.bin.json",
                            "shard-00000-00001.bin", "shard-00000-00001.bin.json"]
    manifest = prepare_corpus([path], options(out, tokenizer="bytes", skip_bad=True), log=quiet)
    assert all((out / name).read_bytes() == data for name, data in kept.items())
    assert manifest["num_bad"] == 2 and manifest["num_documents"] == 28
    assert manifest["bad"] == [f"{path}:21 is not valid JSON (Unterminated string starting at)",
                               f"{path}:26 has no string field 'text'"]
    fresh = tmp_path / "fresh"
    prepare_corpus([path], options(fresh, tokenizer="bytes", skip_bad=True), log=quiet)
    assert {p.name: p.read_bytes() for p in fresh.iterdir() if not p.name.startswith(".")} == \
        {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}


def test_unreadable_files_and_null_rows_are_named(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    broken = tmp_path / "broken.jsonl.gz"
    data = "".join(json.dumps({"text": d}) + "\n" for d in documents(3, 3000)).encode()
    broken.write_bytes(gzip.compress(data)[:30_000])  # a truncated archive
    with pytest.raises(BadInputError, match=rf"{broken}: cannot be read after line \d+ \(EOFError") as error:
        prepare_corpus([broken], options(tmp_path / "o1", tokenizer="bytes", shard_docs=100_000), log=quiet)
    num_read = int(str(error.value).split("after line ")[1].split()[0])
    assert 0 < num_read < 3000
    manifest = prepare_corpus([broken, corpus["inputs"][0]], options(tmp_path / "o2", tokenizer="bytes",
                                                                     shard_docs=100_000, skip_bad=True), log=quiet)
    # Every line read before the damage is kept, the file counts as one bad record, the next input follows.
    assert manifest["num_documents"] == num_read + 23 and manifest["inputs"][0]["bad"] == 1
    assert manifest["bad"] == [str(error.value)]
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), nulls, row_group_size=2)
    with pytest.raises(BadInputError, match=rf"{nulls} \(row group 1, row 0\) has no string field 'text'"):
        prepare_corpus([nulls], options(tmp_path / "o3", tokenizer="bytes"), log=quiet)
    with pytest.raises(BadInputError, match=r"has no column 'body' \(columns: text\); choose one with --field"):
        prepare_corpus([nulls], options(tmp_path / "o4", tokenizer="bytes", text_field="body"), log=quiet)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(BadInputError, match=rf"{not_parquet}: cannot be read as parquet"):
        prepare_corpus([not_parquet], options(tmp_path / "o5", tokenizer="bytes"), log=quiet)


def test_options_and_a_foreign_output_folder_are_refused(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"--workers \(-1\) must be an int >= 0; --format \('hdf5'\) must be one"):
        prepare_corpus(corpus["inputs"], options(tmp_path / "o", num_workers=-1, output_format="hdf5"))
    with pytest.raises(ValueError, match=r"input \('.*nope.jsonl'\) does not exist"):
        prepare_corpus([tmp_path / "nope.jsonl"], options(tmp_path / "o"))
    out = tmp_path / "o"
    prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bytes"), log=quiet)
    with pytest.raises(ValueError, match=r"holds a prepare of other inputs or options \(manifest.json: shard_docs"):
        prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bytes", shard_docs=9), log=quiet)


def test_a_rerun_whose_tokenizer_has_another_eos_is_refused(corpus, tmp_path):
    """The same tokenizer.json with another end-of-text token (named by the files beside it) writes
    other shards: a rerun over the first run's output must not accept them as its own."""
    import shutil

    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(corpus["tokenizer"], tok / "tokenizer.json")
    out = tmp_path / "out"
    first = prepare_corpus(corpus["inputs"][:1], options(out, tokenizer=str(tok / "tokenizer.json")), log=quiet)
    assert first["tokenizer"]["eos_id"] is None
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    with pytest.raises(ValueError, match=r"holds a prepare of other inputs or options \(manifest.json: tokenizer"):
        prepare_corpus(corpus["inputs"][:1], options(out, tokenizer=str(tok / "tokenizer.json")), log=quiet)


def test_a_lone_surrogate_becomes_the_replacement_character(tmp_path):
    """A JSON "\\ud83d" (half an emoji, as web crawls hold) parses to a str that cannot be encoded as
    UTF-8: every stage sees U+FFFD in its place instead of failing."""
    from moetrain.data.documents import Documents
    from moetrain.data.tokenizer import ByteTokenizer

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "good one"}\n{"text": "bad \\ud83d half emoji"}\n{"text": "good two"}\n')
    expected = ["good one", "bad \ufffd half emoji", "good two"]
    for tokenizer in ("bytes", "bpe"):
        manifest = prepare_corpus([path], options(tmp_path / tokenizer, tokenizer=tokenizer, vocab_size=280),
                                  log=quiet)
        assert manifest["num_documents"] == 3 and manifest["num_bad"] == 0
        if tokenizer == "bytes":
            assert np.concatenate(shard_tokens(tmp_path / tokenizer)).astype(np.uint8).tobytes().decode() == \
                "".join(t + "\n" for t in expected)
    docs = Documents([path], label="x")
    assert list(docs) == expected
    assert docs.fingerprint == Documents([_write_lines(tmp_path / "clean.jsonl", expected)], label="y").fingerprint
    assert ByteTokenizer().encode(list(docs)[1]) == list(expected[1].encode())


def _write_lines(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_an_unfinished_prepare_is_refused_as_training_data(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": d}) for d in documents(7, 30)]
    lines[20] = '{"text": "cut'
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(BadInputError):
        prepare_corpus([path], options(out, tokenizer="bytes"), log=quiet)
    assert len(list(out.glob("shard-*.bin"))) == 2 and (out / "progress.json").is_file()
    for where in (out, tmp_path, out / "shard-00000-00000.bin"):  # the folder, a folder above it, one shard
        with pytest.raises(ValueError, match=rf"{out} is an unfinished `moetrain data prepare` output .*"
                                             r"rerun `moetrain data prepare` .* to finish it"):
            prepare_data(DataConfig(corpus="path", path=str(where), seq_len=8))
    prepare_corpus([path], options(out, tokenizer="bytes", skip_bad=True), log=quiet)
    data = prepare_data(DataConfig(corpus="path", path=str(out), seq_len=8, val_fraction=0.1))
    assert sum(len(t) + len(v) for s in data.sources for t, v in zip(s.train, s.val, strict=True)) == \
        sum(len(d) + 1 for i, d in enumerate(documents(7, 30)) if i != 20)


def test_a_rerun_with_another_vocab_size_is_refused_naming_both(corpus, tmp_path):
    out = tmp_path / "out"
    manifest = prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bpe", vocab_size=280), log=quiet)
    with pytest.raises(ValueError, match=r"--vocab-size \(300\) differs from the 280 .*tokenizer.json was trained "
                                         r"with.*--vocab-size 280"):
        prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bpe", vocab_size=300), log=quiet)
    assert prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bpe", vocab_size=280), log=quiet) == manifest
    # An unfinished output (no manifest yet) is checked the same way before a shard is written.
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError, match=r"--vocab-size \(4096\) differs from the 280"):
        prepare_corpus(corpus["inputs"][:1], options(out, tokenizer="bpe"), log=quiet)
