"""Config of text classification (``model.head = "classifier"``): how labelled data is read, split,
tokenised and sampled, and the loss.

The rest of a classification job comes from the sections it shares with language modelling:
``data.corpus`` / ``data.path`` (where the examples are), ``data.seq_len`` (every example is
truncated or right-padded to it), ``data.vocab_size`` (the BPE's size), ``data.val_fraction`` (the
validation examples carved out of the train split, never out of the test split) and ``data.cache_dir``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require, require_choice


@dataclass
class ClassifyConfig:
    tokenizer: str = "bpe"
    """Tokeniser of the examples: "char" = one token per character, the vocabulary being the characters
    seen at least ``min_char_count`` times in the train split (suits Chinese, where a character is
    close to a morpheme and a byte-level BPE would spend its merges rebuilding 3-byte characters);
    "bpe" = a byte-level BPE of ``data.vocab_size`` tokens trained on the train split (English);
    "bytes" = raw UTF-8 bytes. Cached under ``data.cache_dir``. (``data.tokenizer`` is the language
    model's and is not read for a classifier.) A language model (``model.head = "lm"``) on a labelled
    corpus pretrains on its train split with this tokenizer too, so that a classifier of the same data
    starts from its export with the same token ids."""

    min_char_count: int = 2
    """With tokenizer "char": characters seen fewer times in the train split map to the unknown token, so
    that the embedding of a character is learnt from more than one example."""

    text_field: str = "text"
    """Field of the text in a user's .jsonl examples (``data.corpus = "path"``)."""

    label_field: str = "label"
    """Field of the label in a user's .jsonl examples (a string or an integer)."""

    test_fraction: float = 0.1
    """A user's data in one file (``data.path`` = FILE.tsv or FILE.jsonl): the fraction of its examples
    held out as the test split, by a permutation seeded with ``split_seed``. Not used for a train/test
    pair of files or for a registered corpus (the registry fixes its split)."""

    split_seed: int = 0
    """Seed of the permutation that carves the validation set (``data.val_fraction`` of the train
    split) and, for one user file, the test split."""

    balanced_sampling: bool = False
    """Draw training examples with probability inversely proportional to their class's frequency
    (with replacement, a fresh draw per epoch), so that every class is seen equally often; False =
    each epoch visits every training example once, shuffled."""

    token_dropout: float = 0.0
    """Augmentation of the training examples, in [0, 1): each real token is deleted with this probability
    (the end token kept, the rest shifted left), a fresh draw each time an example is seen, the same
    whatever the parallel layout. 0 = off. Evaluation never drops tokens."""

    label_smoothing: float = 0.0
    """Label smoothing of the training cross-entropy, in [0, 1): the target puts 1 - s on the true class
    and s / C on every class. Evaluation losses are plain cross-entropy."""

    def __post_init__(self) -> None:
        require_choice("classify.tokenizer", self.tokenizer, ("char", "bpe", "bytes"))
        require_int("classify.min_char_count", self.min_char_count, min_value=1)
        for name in ("text_field", "label_field"):
            value = getattr(self, name)
            require(isinstance(value, str) and value != "", f"classify.{name}", value, "must be a non-empty string")
        fraction = self.test_fraction
        require(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction < 1,
                "classify.test_fraction", fraction, "must be in (0, 1)")
        require_int("classify.split_seed", self.split_seed)
        require_bool("classify.balanced_sampling", self.balanced_sampling)
        d = self.token_dropout
        require(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d < 1,
                "classify.token_dropout", d, "must be in [0, 1)")
        s = self.label_smoothing
        require(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s < 1,
                "classify.label_smoothing", s, "must be in [0, 1)")
