"""data.path with a registered corpus: refused (the run would train on the corpus instead, for the
whole run), naming the field, its value and the rule; a run config saved by an older moetrain,
which only warned, still loads (the field reset to its default), so the run resumes."""

from __future__ import annotations

import pytest

from moetrain.config import JobConfig
from moetrain.config.base import InactiveFieldError
from moetrain.config.loader import load_config, save_config


def test_data_path_with_a_registered_corpus_is_refused_on_the_command_line():
    with pytest.raises(InactiveFieldError) as e:
        load_config("tiny", ["--data.path=does/not/exist"])
    assert str(e.value) == ("data.path ('does/not/exist') acts only with data.corpus=\"path\" (it is 'shakespeare', "
                            "whose data would be trained on instead): pass --data.corpus=path to train on it")
    cfg = load_config("tiny", ["--data.corpus=path", "--data.path=data/web"])
    assert (cfg.data.corpus, cfg.data.path) == ("path", "data/web")


def test_an_older_runs_saved_config_with_an_ignored_data_path_still_loads(tmp_path):
    file = tmp_path / "config.yaml"
    save_config(JobConfig(), file)
    text = file.read_text()
    assert "  path: null\n" in text
    file.write_text(text.replace("  path: null\n", "  path: data/ignored\n", 1))
    with pytest.warns(UserWarning, match=r"data.path \('data/ignored'\) acts only with .* reset to its default"):
        cfg = load_config(str(file), [])
    assert cfg.data.path is None and cfg.data.corpus == "shakespeare"
    with pytest.raises(InactiveFieldError):  # the user's own override is never reset
        load_config(str(file), ["--data.path=data/other"])
