"""metrics.jsonl as `moetrain report` and `moetrain compare` read it: a record cut short by a crash
mid-write, a bad line inside the file, a folder without the file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.train.compare import load_run
from moetrain.train.metrics import read_metrics

RECORDS = [{"step": s, "loss": 4.0 - s / 2, "tokens_per_s": 1000.0 + s} for s in (1, 2, 3)]


def _run(folder: Path, text: str) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(text)
    return folder


def test_a_record_cut_short_at_the_end_is_left_out(tmp_path, caplog, capsys):
    lines = [json.dumps(r) + "\n" for r in RECORDS]
    torn = json.dumps({"step": 4, "loss": 2.0, "expert_share": [[0.25, 0.75]]})
    run = _run(tmp_path / "crash", "".join(lines) + torn[: len(torn) // 2])
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        assert read_metrics(run) == RECORDS
    assert f"{run / 'metrics.jsonl'}:4: left out a record cut short" in caplog.text
    assert main(["report", str(run)]) == 0
    assert (run / "report" / "loss.png").is_file() and "loss.png" in capsys.readouterr().out
    assert load_run(run, "crash").records == RECORDS  # compare reads it the same way
    # A last line that ends in its newline but is no object (a torn write can end anywhere) too.
    assert read_metrics(_run(tmp_path / "nl", "".join(lines) + '{"step": 4, "lo\n\n')) == RECORDS


def test_a_bad_line_inside_the_file_names_its_line(tmp_path, capsys):
    lines = [json.dumps(r) + "\n" for r in RECORDS]
    run = _run(tmp_path / "bad", lines[0] + '{"step": 2, "lo\n' + lines[2])
    with pytest.raises(ValueError, match=r"bad/metrics\.jsonl:2: not a JSON object"):
        read_metrics(run)
    assert main(["report", str(run)]) == 2
    assert "metrics.jsonl:2: not a JSON object" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: not a JSON object"):
        read_metrics(_run(tmp_path / "list", "[1, 2]\n" + lines[0]))


def test_a_folder_without_metrics_is_a_clean_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moetrain: error: ") and str(tmp_path / "empty") in err and "Traceback" not in err
