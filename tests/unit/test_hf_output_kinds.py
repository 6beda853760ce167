"""An output folder that holds a model of the other format is refused (exit 2 naming the flag, the
folder byte for byte as it was): before, `convert RUN --to-hf EXPORT` replaced an export's weights
with Hugging Face-named ones (its config.yaml left beside them, so it no longer loaded) and
`convert --from-hf H --to OTHER_HF` an HF folder's weights with moetrain-named ones (its config.json
left, so transformers loaded random weights). Writing again into a folder of the kind the command
writes keeps working."""

from __future__ import annotations

import pytest

from moetrain.cli import main
from tests.helpers.hf_tiny_dense import tiny_dense
from tests.helpers.hf_tiny_models import tiny_model


def _snapshot(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def folders(tmp_path):
    tiny_model("mixtral").save_pretrained(tmp_path / "hf")
    tiny_model("mixtral", seed=1).save_pretrained(tmp_path / "other_hf")
    tiny_dense("llama").save_pretrained(tmp_path / "dense")
    for out in ("mt", "other_mt"):
        assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / out)]) == 0
    return tmp_path


@pytest.mark.parametrize(("target", "argv", "message"), [
    ("other_mt", ["convert", "{mt}", "--to-hf", "{target}"], "is a moetrain export"),
    ("other_hf", ["convert", "--from-hf", "{hf}", "--to", "{target}"], "is a Hugging Face model folder"),
    ("other_hf", ["export", "{mt}", "--to", "{target}"], "is a Hugging Face model folder"),
    ("other_hf", ["upcycle", "--from-hf", "{dense}", "--to", "{target}", "--num-experts", "4", "--top-k", "2"],
     "is a Hugging Face model folder"),
])
def test_an_output_folder_of_the_other_format_is_refused(folders, capsys, target, argv, message):
    before = _snapshot(folders / target)
    argv = [a.format(hf=folders / "hf", mt=folders / "mt", dense=folders / "dense", target=folders / target)
            for a in argv]
    assert main(argv) == 2
    flag = argv[argv.index(str(folders / target)) - 1]
    err = capsys.readouterr().err
    assert f"{flag} {str(folders / target)!r} {message}" in err
    assert _snapshot(folders / target) == before


def test_writing_again_into_a_folder_of_the_same_kind_works(folders):
    for _ in range(2):
        assert main(["convert", str(folders / "mt"), "--to-hf", str(folders / "hf_out")]) == 0
        assert main(["convert", "--from-hf", str(folders / "hf"), "--to", str(folders / "other_mt")]) == 0
        assert main(["export", str(folders / "mt"), "--to", str(folders / "mt_copy")]) == 0
        assert main(["upcycle", "--from-hf", str(folders / "dense"), "--to", str(folders / "up"),
                     "--num-experts", "4", "--top-k", "2"]) == 0
