"""checkpoint.keep_last in a folder that holds another run's checkpoints: rotation ranks only this
run's steps (up to the one saved), and a run that starts below the folder's newest checkpoint
(``checkpoint.resume=never``, or a resume from an older one) names the higher ones in a warning and
deletes nothing."""

import logging
import warnings

import pytest
import torch
from torch import nn

from moetrain.config import CheckpointConfig, JobConfig
from moetrain.train.checkpoint.checkpointer import Checkpointer
from moetrain.train.checkpoint.files import LATEST, latest_checkpoint, list_checkpoints, step_dir_name
from moetrain.train.checkpoint.index import read_trainer_state
from moetrain.train.checkpoint.state import save_checkpoint


def _save(folder, step: int, run: int) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        save_checkpoint(folder, step, model=model, optimizer=optimizer, trainer_state={"step": step, "run": run},
                        keep_last=2)


def _start(folder, resume: str, caplog) -> tuple[str | None, list[str]]:
    """What a run starting on ``folder`` with ``checkpoint.resume=resume`` picks, and its warnings."""
    # Only what picking reads: the job's config and the folder (the training objects are not touched).
    checkpointer = Checkpointer(JobConfig(checkpoint=CheckpointConfig(resume=resume)), folder=folder,
                                objects=None, dims=None, phase=None, vocab_size=None, is_main=True)  # type: ignore[arg-type]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        choice = checkpointer._resume_choice()
    assert not isinstance(choice, Exception), choice
    return choice, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _runs(folder) -> dict[int, int]:
    """Step -> the run that saved it, read from each checkpoint itself."""
    return {step: read_trainer_state(path)["run"] for step, path in list_checkpoints(folder)}


def test_a_fresh_run_in_a_used_folder_rotates_its_own_checkpoints_and_names_the_others(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):  # run 1: 8 steps, keep_last=2
        _save(folder, step, run=1)
    assert _runs(folder) == {6: 1, 8: 1}

    # Run 2 starts over in the same folder (the fix troubleshooting.md gives for another model).
    choice, warned = _start(folder, "never", caplog)
    assert choice is None and len(warned) == 1
    assert step_dir_name(6) in warned[0] and step_dir_name(8) in warned[0] and "past step 0" in warned[0]
    for step in (2, 4, 6):  # 6 steps, keep_last=2
        _save(folder, step, run=2)
    # Its own newest two; run 1's step 6 was replaced by run 2's, its step 8 is left (not deleted).
    assert _runs(folder) == {4: 2, 6: 2, 8: 1}
    assert (folder / LATEST).read_text().strip() == step_dir_name(6)

    # Run 2 resumed: it continues from its own step 6 and names run 1's step 8.
    choice, warned = _start(folder, "auto", caplog)
    assert choice == str(folder / step_dir_name(6)) and len(warned) == 1
    assert step_dir_name(8) in warned[0] and step_dir_name(6) not in warned[0]
    # A rollback to step 4 names both higher ones; none of the picks deleted anything.
    choice, warned = _start(folder, str(folder / step_dir_name(4)), caplog)
    assert choice == str(folder / step_dir_name(4)) and len(warned) == 1
    assert step_dir_name(6) in warned[0] and step_dir_name(8) in warned[0] and "past step 4" in warned[0]
    assert _runs(folder) == {4: 2, 6: 2, 8: 1}


@pytest.mark.parametrize("keep_last", [1, 3])
def test_rotation_keeps_the_newest_up_to_the_saved_step(tmp_path, keep_last):
    folder = tmp_path / "checkpoints"
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        for step in (10, 1, 2, 3, 4):  # a step-10 checkpoint, then a run from step 1
            save_checkpoint(folder, step, model=model, optimizer=optimizer, trainer_state={"step": step},
                            keep_last=keep_last)
    assert [s for s, _ in list_checkpoints(folder)] == [*range(5 - keep_last, 5), 10]
    assert (folder / LATEST).read_text().strip() == step_dir_name(4)
    assert latest_checkpoint(folder) == folder / step_dir_name(4)
