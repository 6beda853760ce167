"""The class mapping of a classifier run (RUN/classes.json) held against the data that `moetrain eval`
(and a resume) builds: the head's row i is class i of the file, so data with other names, another
order or another count must be refused by name, not scored against the wrong rows."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from moetrain.config.loader import load_config, save_config
from moetrain.train.classification import CLASSES_FILE, check_run_classes
from tests.helpers.dist_launcher import run_ranks

CLASSES = [str(i) for i in range(11)]


def _run_dir(tmp_path: Path, classes: list[str]) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / CLASSES_FILE).write_text(json.dumps({"classes": classes, "examples": {}}))
    return run


def test_same_classes_pass(tmp_path):
    check_run_classes(list(CLASSES), _run_dir(tmp_path, CLASSES), num_classes=11)


def test_renamed_added_and_reordered_classes_are_refused_by_name(tmp_path):
    run = _run_dir(tmp_path, CLASSES)
    renamed = CLASSES[:3] + ["99"] + CLASSES[4:]
    with pytest.raises(ValueError, match=r"run/classes\.json\): other class names; from class id 3 the data has "
                                         r"\['99', '4', .*\], the run \['3', '4', "):
        check_run_classes(renamed, run)
    with pytest.raises(ValueError, match=r"12 classes in the data, 11 in the run; from class id 11 the data has "
                                         r"\['11'\], the run \[\]"):
        check_run_classes(CLASSES + ["11"], run)
    # A run that numbered integer labels as text ("10" before "2"): the same names in another order.
    as_text = sorted(CLASSES)
    with pytest.raises(ValueError, match=r"the same classes in another order; from class id 2 the data has "
                                         r"\['2', '3', .*\], the run \['10', '2', .*Integer labels are now sorted "
                                         r"numerically.*cannot be continued or evaluated"):
        check_run_classes(CLASSES, _run_dir(tmp_path, as_text))
    with pytest.raises(ValueError, match=r"another order; from class id 0 the data has \['b', 'a'\], the run "
                                         r"\['a', 'b'\]\.$"):
        check_run_classes(["b", "a"], _run_dir(tmp_path, ["a", "b"]))


def test_a_run_without_classes_json_is_checked_on_the_count(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        check_run_classes(["a", "b"], tmp_path, num_classes=2)
    assert "classes.json is missing" in caplog.text
    with pytest.raises(ValueError, match=r"the run's model has 3 classes \(model.num_classes\), the data 2"):
        check_run_classes(["a", "b"], tmp_path, num_classes=3)


def _eval(rank: int, world_size: int, run_dir: Path, checkpoint: Path) -> str:
    from moetrain.train.evaluate import evaluate_run

    try:
        evaluate_run(run_dir, checkpoint=str(checkpoint))
    except ValueError as e:
        return str(e)
    return "no error"


def test_eval_refuses_data_whose_classes_changed(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.tsv", "test.tsv"):
        (data / name).write_text("".join(f"c{i % 3}\tword {i}\n" for i in range(40)))
    cfg = load_config("tiny", ["--model.head=classifier", "--model.num_classes=3", "--model.causal=false",
                               "--model.pooling=mean", "--data.corpus=path", f"--data.path={data}",
                               "--data.seq_len=16", "--model.max_seq_len=16", f"--data.cache_dir={tmp_path / 'c'}",
                               "--classify.tokenizer=char", "--classify.min_char_count=1", "--train.device=cpu",
                               f"--log.run_dir={tmp_path / 'run'}"])
    run = _run_dir(tmp_path, ["c0", "c1", "c2"])
    save_config(cfg, run / "config.yaml")
    checkpoint = run / "checkpoints" / "step_000000004"  # never read: the check comes first
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_text("")
    for name in ("train.tsv", "test.tsv"):  # class c1 renamed: still 3 classes
        (data / name).write_text((data / name).read_text().replace("c1\t", "c9\t"))
    message = run_ranks(_eval, 1, run, checkpoint, timeout_s=120)[0]
    assert f"({run / CLASSES_FILE})" in message and "from class id 1 the data has ['c2', 'c9']" in message


def test_a_classifier_started_from_a_classifiers_export_is_held_to_its_classes(tmp_path):
    # The export carries classes.json (moetrain export copies it); a run that keeps its head starts
    # from rows that are the export's classes, so other data is refused, as on resume.
    from types import SimpleNamespace

    from moetrain.interop.export import copy_classes
    from moetrain.train.task import write_run_record

    export = tmp_path / "export"
    export.mkdir()
    copy_classes(_run_dir(tmp_path, ["neg", "neu", "pos"]), export)
    job = ["--model.head=classifier", "--model.num_classes=3", "--data.corpus=r8",
           f"--checkpoint.init_from={export}"]
    data = SimpleNamespace(classes=["bad", "good", "meh"])
    with pytest.raises(ValueError, match=r"differ from those the run was trained with .*export/classes.json"):
        write_run_record(load_config(None, job), data, tmp_path / "new", resumed=False, is_main=False)
    # A new head (init_from_new_head) has no rows to hold the data to.
    write_run_record(load_config(None, [*job, "--checkpoint.init_from_new_head=true"]), data, tmp_path / "new",
                     resumed=False, is_main=False)
