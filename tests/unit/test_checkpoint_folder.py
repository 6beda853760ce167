"""The checkpoint folder's crash rules (``train.checkpoint.files``): whatever moment a save is
killed at, the next start finds the previous complete checkpoint or the new one, never nothing.
Here: the same-step re-save, whose old checkpoint is moved aside before the new one is renamed
into place, killed between the two renames."""

import errno
import json
import os
import re
import warnings

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from moetrain.train.checkpoint import state
from moetrain.train.checkpoint.files import (
    LATEST,
    MANIFEST,
    clean_stale_tmp,
    commit_checkpoint,
    latest_checkpoint,
    step_dir_name,
)
from moetrain.train.checkpoint.state import save_checkpoint


def _saved(folder, step: int, marker: str):
    """A finished save's temporary folder: one data file and what commit_checkpoint needs."""
    tmp = folder / f".{step_dir_name(step)}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "data").write_text(marker)
    return tmp


def test_a_kill_between_the_renames_of_a_same_step_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    final = tmp_path / step_dir_name(4)
    commit_checkpoint(_saved(tmp_path, 4, "first"), final, step=4, world_size=1, layout={}, files={}, keep_last=1)
    assert (final / MANIFEST).is_file() and (tmp_path / LATEST).read_text().strip() == final.name

    # The second save of step 4 dies right after moving the first aside: the process is gone
    # before its new folder is renamed into place (os.replace raising stands for the kill).
    real_replace = os.replace
    second = tmp_path / f".{final.name}.tmp"

    def killed_after_first_rename(src, dst):
        if str(src) == str(second) and str(dst) == str(final):
            raise SystemExit("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_after_first_rename)
    with pytest.raises(SystemExit, match="killed"):
        commit_checkpoint(_saved(tmp_path, 4, "second"), final, step=4, world_size=1, layout={}, files={},
                          keep_last=1)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not final.exists() and len(list(tmp_path.glob(f".{final.name}.old-*"))) == 1 and second.is_dir()

    # The next start: the moved-aside checkpoint is complete and goes back; the unfinished one goes.
    removed = clean_stale_tmp(tmp_path)
    assert [p.name for p in removed] == [f".{final.name}.tmp"]
    assert latest_checkpoint(tmp_path) == final and (final / "data").read_text() == "first"
    assert json.loads((final / MANIFEST).read_text())["step"] == 4
    assert not list(tmp_path.glob(".step_*"))


def test_the_debris_of_a_save_killed_before_its_commit_is_removed(tmp_path):
    _saved(tmp_path, 2, "unfinished")  # no manifest: never committed
    aside = tmp_path / f".{step_dir_name(3)}.old-99"  # moved aside, yet step 3 is in place
    aside.mkdir()
    (aside / MANIFEST).write_text("{}")
    (tmp_path / step_dir_name(3)).mkdir()
    (tmp_path / step_dir_name(3) / MANIFEST).write_text("{}")
    assert sorted(p.name for p in clean_stale_tmp(tmp_path)) == [f".{step_dir_name(2)}.tmp", aside.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(3)]


class _FullDisk(FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_write_names_the_step_the_folder_and_the_free_space_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        first = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, trainer_state={"step": 1})
        monkeypatch.setattr(state, "checkpoint_writer", lambda tmp: _FullDisk(tmp))
        with pytest.raises(RuntimeError) as error:
            save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, trainer_state={"step": 2})
    message = str(error.value)
    assert f"saving checkpoint {tmp_path / step_dir_name(2)} failed" in message
    assert re.search(r"DCP's write failed \(\d+ MiB free on the filesystem of \S+\): rank 0: OSError: "
                     r"\[Errno 28\] No space left on device", message), message
    assert latest_checkpoint(tmp_path) == first and not (tmp_path / step_dir_name(2)).exists()
