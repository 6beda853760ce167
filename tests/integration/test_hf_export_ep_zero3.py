"""Export from a run trained with expert parallelism x ZeRO-3 (`moetrain train --nproc 2` at
parallel.ep=2, parallel.zero_stage=3: each rank holds half of the experts and half of every dense
weight) gathers every expert: ``moetrain convert RUN --to-hf`` equals, bit for bit, the export of
the same weights at world 1, where the checkpoint is first consolidated by the training code's
own loader into a plain single-process model (``load_model_weights`` + ``load_state_dict``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import job_overrides

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "moetrain.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_an_ep2_zero3_run_equals_the_world1_export(tmp_path, shakespeare_cached):
    from moetrain.interop.export import build_model, write_export
    from moetrain.interop.hf import export_hf
    from moetrain.train.checkpoint.files import latest_checkpoint
    from moetrain.train.checkpoint.index import load_model_weights
    from moetrain.utils.safetensors_io import SafetensorsFolder

    run = tmp_path / "run"
    extra = ("--parallel.zero_stage=3", "--moe.activation=swiglu", "--model.activation=swiglu", "--moe.top_k=2")
    trained = _cli("train", "--nproc", "2", *job_overrides(run, steps=3, ep=2, extra=extra))
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    ckpt = latest_checkpoint(run / "checkpoints")
    assert '"zero_stage": 3' in (ckpt / "manifest.json").read_text()

    conv = _cli("convert", str(run), "--to-hf", str(tmp_path / "from_run"))
    assert conv.returncode == 0, conv.stdout + conv.stderr

    # World 1: the training code's loader consolidates the shards into one plain model.
    tensors, state = load_model_weights(ckpt)
    model = build_model(state["config"], tensors)
    assert not any(hasattr(p, "placements") for p in model.parameters())
    write_export(tmp_path / "world1", config=state["config"], state_dict=model.state_dict())
    export_hf(tmp_path / "world1", tmp_path / "from_world1")

    a, b = SafetensorsFolder(tmp_path / "from_run"), SafetensorsFolder(tmp_path / "from_world1")
    assert sorted(a.names()) == sorted(b.names())
    experts = {n for n in a.names() if ".experts." in n}
    assert len(experts) == 2 * 4 * 3  # 2 blocks x 4 experts x (w1, w3, w2): both ranks' halves
    for name in a.names():
        assert a.info(name).dtype == b.info(name).dtype and torch.equal(a.get(name), b.get(name)), name
    # Trained: the weights moved away from the seed's init, so the comparison is not of two inits.
    from moetrain.models.transformer import Transformer

    init = Transformer(model.config, moe=model.moe_config, seed=state["config"]["train"]["seed"]).state_dict()
    assert not torch.equal(init["layers.1.feed_forward.experts.w2"], model.state_dict()["layers.1.feed_forward.experts.w2"])
