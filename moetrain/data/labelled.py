"""Labelled text examples for classification: the readers and the train/val/test split.

Formats (every error names the file, the 1-based line number and the rule):

- ``.tsv``: one example per line, ``label<TAB>text`` (the text may not contain a tab; blank lines are
  skipped). THUCNews ships in this format.
- ``.jsonl``: one JSON object per line with a label field (a string or an integer) and a text field
  (``classify.label_field`` / ``classify.text_field``).
- ``.tab``: an Orange data table: row 1 the column names, row 2 their types ("d" discrete, "string",
  ...), row 3 their flags; the column flagged "class" is the label, the first "string" column the
  text; rows of empty cells are skipped. R8, R52 and 20 Newsgroups ship in this format.

Splits: test comes from the data (a registered corpus's test file or its fixed-seed split; a user's
test file or ``classify.test_fraction`` of a single file); validation is always carved out of the
train split (``data.val_fraction``, seeded by ``classify.split_seed``), so that model selection never
sees the test examples; a class that a held-out split would take whole keeps one example in train.
Class ids are the sorted train labels (numerically sorted when every label is an integer); a test label
that training never saw is an error naming its line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.config.classify import ClassifyConfig
from moetrain.config.data import DataConfig
from moetrain.data.cache import cached_corpus_files, fetch_corpus
from moetrain.data.documents import valid_text
from moetrain.data.registry import get_corpus

LABELLED_SUFFIXES = (".tsv", ".jsonl", ".tab")


@dataclass
class Examples:
    """Texts with their string labels, each remembering where it came from (for error messages)."""

    texts: list[str]
    labels: list[str]
    where: list[str]
    """``"FILE:LINE"`` of each example."""

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, index: np.ndarray) -> Examples:
        return Examples([self.texts[i] for i in index], [self.labels[i] for i in index],
                        [self.where[i] for i in index])


def _read_lines(path: Path) -> list[str]:
    """The lines of ``path``, ended by "\n" only (a trailing "\r" stripped): str.splitlines also
    splits at U+0085, U+2028/2029, \x0b, \x0c and \x1c-\x1e, which are text inside an example
    (and valid raw inside a JSON string), and would shift every later line number."""
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": no translation of a lone \r
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line starts no line
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_tsv(path: Path) -> Examples:
    """``label<TAB>text`` lines."""
    out = Examples([], [], [])
    for line_no, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(f"{path}:{line_no}: a .tsv example must be 'label<TAB>text' with a non-empty "
                             f"label and text and exactly one tab, got {line[:80]!r}")
        _add(out, parts[0].strip(), parts[1], f"{path}:{line_no}")
    return out


def read_jsonl(path: Path, *, label_field: str = "label", text_field: str = "text") -> Examples:
    """One JSON object per line with ``label_field`` (str or int) and ``text_field`` (str)."""
    out = Examples([], [], [])
    for line_no, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        label = record.get(label_field) if isinstance(record, dict) else None
        text = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(label, bool) or not isinstance(label, (str, int)) or not str(label).strip():
            raise ValueError(f"{path}:{line_no}: the label field {label_field!r} must be a non-empty string "
                             f"or an integer (classify.label_field), got {label!r}")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{line_no}: the text field {text_field!r} must be a non-empty string "
                             f"(classify.text_field), got {text!r}")
        _add(out, valid_text(str(label).strip()), valid_text(text), f"{path}:{line_no}")
    return out


def read_orange_tab(path: Path) -> Examples:
    """An Orange data table (see the module docstring for its three header rows)."""
    lines = _read_lines(path)
    if len(lines) < 3:
        raise ValueError(f"{path}: an Orange .tab file needs 3 header rows (names, types, flags), "
                         f"it has {len(lines)} lines")
    names, types, flags = (lines[i].split("\t") for i in range(3))
    flags += [""] * (len(names) - len(flags))
    types += [""] * (len(names) - len(types))
    label_cols = [i for i, f in enumerate(flags) if "class" in f.split()]
    text_cols = [i for i, t in enumerate(types) if t.strip() in ("string", "s", "text")]
    if len(label_cols) != 1 or not text_cols:
        raise ValueError(f"{path}:3: an Orange .tab file needs exactly one column flagged 'class' (the label) and "
                         f"a 'string' column (the text); found class columns {label_cols}, string columns "
                         f"{text_cols} in the names {names}")
    label_col, text_col = label_cols[0], text_cols[0]
    out = Examples([], [], [])
    for line_no, line in enumerate(lines[3:], start=4):
        cells = line.split("\t")
        if not any(c.strip() for c in cells):
            continue
        if len(cells) != len(names) or not cells[label_col].strip() or not cells[text_col].strip():
            raise ValueError(f"{path}:{line_no}: a row must have {len(names)} tab-separated cells with a non-empty "
                             f"{names[label_col]!r} (label) and {names[text_col]!r} (text), got {line[:80]!r}")
        _add(out, cells[label_col].strip(), cells[text_col], f"{path}:{line_no}")
    return out


def _add(out: Examples, label: str, text: str, where: str) -> None:
    out.labels.append(label)
    out.texts.append(text)
    out.where.append(where)


READERS = {"labelled_tsv": read_tsv, "jsonl": read_jsonl, "orange_tab": read_orange_tab}
"""Format name (a registry parser, or "jsonl") -> reader."""

_FORMAT_OF_SUFFIX = {".tsv": "labelled_tsv", ".jsonl": "jsonl", ".tab": "orange_tab"}


def read_examples(path: Path, fmt: str | None = None, cfg: ClassifyConfig | None = None) -> Examples:
    """The examples of one file in format ``fmt`` (None = by the file's suffix)."""
    cfg = cfg or ClassifyConfig()
    fmt = fmt or _FORMAT_OF_SUFFIX.get(path.suffix)
    if fmt is None:
        raise ValueError(f"{path}: labelled data must be a .tsv, .jsonl or Orange .tab file")
    if fmt == "jsonl":
        return read_jsonl(path, label_field=cfg.label_field, text_field=cfg.text_field)
    return READERS[fmt](path)


@dataclass
class LabelledSplits:
    """The three splits of a labelled data set, with the class names (class id = index)."""

    train: Examples
    val: Examples
    test: Examples
    classes: list[str]
    source: str
    """What the data is, for messages (e.g. "corpus 'thucnews'")."""

    def label_ids(self, split: str) -> np.ndarray:
        """Class ids [N] of ``split``; a label training never saw is an error naming its line."""
        examples = getattr(self, split)
        index = {c: i for i, c in enumerate(self.classes)}
        ids = np.empty(len(examples), dtype=np.int64)
        for n, (label, where) in enumerate(zip(examples.labels, examples.where, strict=True)):
            if label not in index:
                raise ValueError(f"{where}: unknown label {label!r} in the {split} split: every label must occur in "
                                 f"the train split of {self.source} ({len(self.classes)} classes: "
                                 f"{', '.join(self.classes[:12])}{', ...' if len(self.classes) > 12 else ''})")
            ids[n] = index[label]
        return ids


def _permutation(n: int, seed: int, salt: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, salt])))
    return rng.permutation(n)


def _hold_out(examples: Examples, fraction: float, *, seed: int, salt: int) -> tuple[Examples, Examples]:
    """(rest, held out): ``round(N * fraction)`` examples picked by a seeded permutation, each part in
    the file's order; of a class the pick would take whole, its first picked example stays in the rest
    (the train split must hold every class its val/test splits have)."""
    order = _permutation(len(examples), seed, salt)
    num_held = round(len(examples) * fraction)
    held, rest = order[:num_held], order[num_held:]
    kept = {examples.labels[i] for i in rest}
    returned = []
    for i in held:
        if examples.labels[i] not in kept:
            kept.add(examples.labels[i])
            returned.append(i)
    if returned:
        held, rest = held[~np.isin(held, returned)], np.concatenate([rest, returned])
    return examples.take(np.sort(rest)), examples.take(np.sort(held))


def class_order(labels: set[str]) -> list[str]:
    """The class names in class-id order: numerically when every label is an integer ("2" before "10"),
    else as sorted text."""
    if all(INTEGER_LABEL.fullmatch(label) for label in labels):
        return sorted(labels, key=lambda label: (int(label), label))
    return sorted(labels)


INTEGER_LABEL = re.compile(r"[+-]?[0-9]+")
"""A label that sorts as a number when every label of the data is one."""


def _train_test_files(files: list[Path], where: str) -> tuple[Path, Path]:
    train = [f for f in files if "train" in f.name]
    test = [f for f in files if "test" in f.name]
    if len(train) != 1 or len(test) != 1 or train == test:
        raise ValueError(f"{where} must hold one file whose name contains 'train' and one whose name contains "
                         f"'test', found {[f.name for f in files]}")
    return train[0], test[0]


def _user_files(path: str) -> list[Path]:
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"data.path ({path!r}) does not exist")
    files = [root] if root.is_file() else sorted(p for p in root.iterdir()
                                                  if p.is_file() and p.suffix in LABELLED_SUFFIXES)
    if not files:
        raise ValueError(f"data.path ({path!r}) holds no .tsv, .jsonl or .tab file")
    if len(files) > 2 or (len(files) == 1 and root.is_dir()):
        raise ValueError(f"data.path ({path!r}) must be one labelled file or a folder with a train/test pair, "
                         f"found {[f.name for f in files]}")
    return files


def load_splits(data: DataConfig, cfg: ClassifyConfig, *, download: bool = True) -> LabelledSplits:
    """The train/val/test examples of ``data.corpus`` (a labelled registered corpus, fetched unless
    cached, or "path"), split as the module docstring says."""
    test_fraction: float | None
    if data.corpus == "path":
        assert data.path is not None, "DataConfig requires data.path with corpus 'path'; job forbids data.sources"
        files, source = _user_files(data.path), f"data.path {data.path!r}"
        test_fraction, split_seed, fmt = cfg.test_fraction, cfg.split_seed, None
    else:
        corpus = get_corpus(data.corpus)
        if not corpus.is_labelled:
            raise ValueError(f"data.corpus ({data.corpus!r}) is a text corpus for language modelling; a classifier "
                             "(model.head='classifier') needs a labelled corpus or data.corpus='path'")
        if download:
            fetch_corpus(data.corpus, data.cache_dir)  # no network when cached
        files, source = cached_corpus_files(data.corpus, data.cache_dir), f"corpus {data.corpus!r}"
        test_fraction, split_seed, fmt = corpus.test_fraction, corpus.split_seed, corpus.parser
    if len(files) == 1:
        if test_fraction is None:
            raise ValueError(f"{source} has one file and no test fraction to split it with")
        train, test = _hold_out(read_examples(files[0], fmt, cfg), test_fraction, seed=split_seed, salt=0)
    else:
        train_file, test_file = _train_test_files(files, source)
        train, test = read_examples(train_file, fmt, cfg), read_examples(test_file, fmt, cfg)
    # Salt 1: the validation carve is independent of the test split even under the same seed.
    train, val = _hold_out(train, data.val_fraction, seed=cfg.split_seed, salt=1)
    classes = class_order(set(train.labels))
    if len(classes) < 2:
        raise ValueError(f"the train split of {source} has {len(classes)} distinct label(s); classification "
                         "needs at least 2")
    if not len(val) or not len(test):
        raise ValueError(f"{source}: the val ({len(val)}) and test ({len(test)}) splits must not be empty; "
                         "use more data or a larger data.val_fraction / classify.test_fraction")
    return LabelledSplits(train=train, val=val, test=test, classes=classes, source=source)
