"""``moetrain upcycle`` and ``moetrain experts grow`` refuse an output folder on their source
(exit 2, the source byte for byte as it was): before, `upcycle --from-hf H --to H` replaced the
dense model's weights with the MoE's and `experts grow RUN --to RUN` the run's config.yaml with the
grown export's, both with exit 0."""

from __future__ import annotations

import pytest

from moetrain.cli import main
from tests.helpers.hf_tiny_dense import tiny_dense
from tests.unit.test_grow_experts import _train


def _snapshot(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("out", ["{hf}", "{hf}/.."])
def test_upcycle_onto_its_source_is_refused(tmp_path, capsys, out):
    tiny_dense("llama").save_pretrained(tmp_path / "hf")
    before = _snapshot(tmp_path / "hf")
    code = main(["upcycle", "--from-hf", str(tmp_path / "hf"), "--to", out.format(hf=tmp_path / "hf"),
                 "--num-experts", "4", "--top-k", "2"])
    assert code == 2
    assert "--to " in capsys.readouterr().err
    assert _snapshot(tmp_path / "hf") == before


def test_experts_grow_onto_its_source_run_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    _train(None, ["--model.dim=32", "--model.num_layers=2", "--model.num_heads=4", "--model.max_seq_len=16",
                  "--moe.num_experts=4", "--moe.top_k=1", "--moe.expert_hidden_dim=16", "--data.corpus=path",
                  f"--data.path={tmp_path / 'docs.txt'}", "--data.tokenizer=bytes", "--data.seq_len=16",
                  "--train.steps=1", "--train.global_batch_size=2", "--train.micro_batch_size=2",
                  "--train.eval_every=0", "--train.device=cpu", "--log.progress_bar=false",
                  "--log.tensorboard=false", "--log.report=false", "--log.run_dir=run"])
    before = _snapshot(tmp_path / "run")
    for out in ("run", ".", "run/checkpoints/grown"):
        assert main(["experts", "grow", "run", "--num-experts", "8", "--to", out]) == 2, out
        assert "--to " in capsys.readouterr().err
        assert _snapshot(tmp_path / "run") == before
    # The documented place of a run's export, inside the run folder, stays allowed.
    assert main(["experts", "grow", "run", "--num-experts", "8", "--to", "run/grown"]) == 0
