"""An output folder that is the source, holds it, lies inside a run's checkpoints or is a run/checkpoint
folder is refused (exit 2, the source untouched): before, `convert --from-hf HF --to HF`, `convert MT
--to-hf MT` and `export RUN --to RUN` overwrote the source with the converted model and exited 0. A
new folder inside an HF folder, an export or a run (outside its checkpoints) harms nothing: their
readers (transformers, hf_fingerprint, is_export) look at top-level files only."""

from __future__ import annotations

import pytest

from moetrain.cli import main
from moetrain.interop.export import check_output_folder
from tests.helpers.hf_tiny_models import tiny_model


def _snapshot(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def folders(tmp_path):
    tiny_model("mixtral").save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    return tmp_path


@pytest.mark.parametrize(("source", "argv"), [
    ("hf", ["convert", "--from-hf", "{hf}", "--to", "{hf}"]),
    ("mt", ["convert", "{mt}", "--to-hf", "{mt}"]),
    ("mt", ["export", "{mt}", "--to", "{mt}"]),
    ("mt", ["convert", "{mt}", "--to-hf", "{mt}/.."]),
])
def test_an_output_folder_on_the_source_is_refused_and_the_source_kept(folders, capsys, source, argv):
    before = _snapshot(folders / source)
    argv = [a.format(hf=folders / "hf", mt=folders / "mt") for a in argv]
    assert main(argv) == 2
    flag = argv[-2]
    assert f"{flag} " in capsys.readouterr().err
    assert _snapshot(folders / source) == before


@pytest.mark.parametrize("kind", ["run", "checkpoint"])
def test_an_output_folder_that_is_a_run_or_a_checkpoint_is_refused(folders, capsys, kind):
    target = folders / "target"
    if kind == "run":
        (target / "checkpoints").mkdir(parents=True)
        (target / "config.yaml").write_text("model: {}\n")
    else:
        target.mkdir()
        (target / ".metadata").write_bytes(b"dcp")
    before = _snapshot(target)
    for argv in (["export", str(folders / "mt"), "--to", str(target)],
                 ["convert", str(folders / "mt"), "--to-hf", str(target)],
                 ["convert", "--from-hf", str(folders / "hf"), "--to", str(target)]):
        assert main(argv) == 2
        assert f"is a moetrain {kind} folder" in capsys.readouterr().err
        assert _snapshot(target) == before


def test_an_export_inside_a_run_folder_is_allowed_outside_its_checkpoints(tmp_path):
    # `moetrain export RUN --to RUN/export` is the documented recipe (docs/classification.md).
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000000002").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    check_output_folder(run, run / "export", "--to")
    with pytest.raises(ValueError, match="--to .* would overwrite the source"):
        check_output_folder(run, run / "checkpoints" / "export", "--to")
    with pytest.raises(ValueError, match="--to .* would overwrite the source"):
        check_output_folder(run, run, "--to")
    step = run / "checkpoints" / "step_000000002"
    with pytest.raises(ValueError, match="--to .* would overwrite the source"):
        check_output_folder(step, step / "export", "--to")


@pytest.mark.parametrize("argv", [
    ["convert", "--from-hf", "{hf}", "--to", "{hf}/inner"],
    ["export", "{mt}", "--to", "{mt}/inner"],
    ["convert", "{mt}", "--to-hf", "{mt}/inner"],
])
def test_a_new_folder_inside_an_hf_folder_or_an_export_is_allowed(folders, argv):
    # Before 7ae5494 these worked (`convert --from-hf hf_mix --to hf_mix/mt`); the source's own files stay.
    source = folders / argv[1 + (argv[1] == "--from-hf")].format(hf="hf", mt="mt")
    before = _snapshot(source)
    assert main([a.format(hf=folders / "hf", mt=folders / "mt") for a in argv]) == 0
    assert {k: v for k, v in _snapshot(source).items() if k.parts[0] != "inner"} == before


def test_a_run_started_from_hf_may_keep_its_run_folder_inside_the_hf_folder(folders, monkeypatch):
    # `cd HF && moetrain train --init-from-hf . --log.run_dir=runs/x`: the conversion cache lands in
    # runs/x/hf_init, a new folder that the HF model's readers never look at.
    from moetrain.interop.hf.train_from import init_from_hf_overrides

    monkeypatch.chdir(folders / "hf")
    before = _snapshot(folders / "hf")
    out = init_from_hf_overrides(".", config=None, overrides=["--log.run_dir=runs/x"])
    assert "--checkpoint.init_from=runs/x/hf_init" in out
    assert {k: v for k, v in _snapshot(folders / "hf").items() if k.parts[0] != "runs"} == before


def test_an_init_cache_on_the_hf_folder_is_refused_naming_the_cache(folders):
    from moetrain.interop.hf.train_from import convert_once

    with pytest.raises(ValueError, match=r"^the --init-from-hf conversion \(log\.run_dir/hf_init\) .* would "
                                         "overwrite the source"):
        convert_once(folders / "hf", folders / "hf")
