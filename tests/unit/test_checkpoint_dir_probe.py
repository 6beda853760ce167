"""The start-up probe of ``checkpoint.dir`` (``checkpoint_dir_error``) leaves no checkpoint folder it
created: `moetrain export` tells a run that never saved (no folder) from one whose saves were cut
short (a folder without a complete checkpoint)."""

from moetrain.train.checkpoint.files import checkpoint_dir_error


def test_a_folder_the_probe_created_is_removed_again(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    assert checkpoint_dir_error(folder) is None
    assert not folder.exists() and folder.parent.is_dir()


def test_an_existing_folder_keeps_its_files_and_gets_no_probe_left(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "keep.txt").write_text("x")
    assert checkpoint_dir_error(folder) is None
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


def test_an_unwritable_folder_is_named(tmp_path):
    (tmp_path / "a_file").write_text("")
    error = checkpoint_dir_error(tmp_path / "a_file" / "ck")
    assert error is not None and error.startswith("checkpoint.dir (") and "cannot be written" in error
