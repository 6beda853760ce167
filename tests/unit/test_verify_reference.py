"""--work reuses the world-1 reference only for the same job, steps and init_from export."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.verify import runs
from moetrain.verify.runs import Run, export_digest, reference_run


@pytest.fixture
def trained(monkeypatch) -> list[str]:
    """The reference runs started (a stand-in for the training launch, which only has to leave its folder)."""
    calls: list[str] = []

    def fake_train(name: str, config: Path, work: Path, **_) -> Run:
        calls.append(name)
        (work / name).mkdir()
        return Run(name, work / name, work / f"{name}.log")

    monkeypatch.setattr(runs, "train", fake_train)
    return calls


def test_a_changed_init_from_export_retrains_the_reference(tmp_path, trained):
    work, job = tmp_path / "work", tmp_path / "job.yaml"
    work.mkdir()
    # The job's text names WORK/init_from whichever export it was cut from: only the digest differs.
    job.write_text("checkpoint:\n  init_from: WORK/init_from\n", encoding="utf-8")
    a, b = tmp_path / "exportA", tmp_path / "exportB"
    for folder, size in ((a, 8), (b, 16)):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * size)

    def ref(export: Path) -> None:
        reference_run(work, job, 2, ["--train.steps=3"], lambda _: None, None, source=export_digest(export))

    ref(a)
    ref(a)
    assert trained == ["reference"]  # the same export: reused
    ref(b)
    assert trained == ["reference"] * 2
    (b / "model.safetensors").write_bytes(b"y" * 32)  # the same path, rewritten
    ref(b)
    assert trained == ["reference"] * 3
