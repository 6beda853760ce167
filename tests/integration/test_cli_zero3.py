"""ZeRO-3 with expert parallelism through the command line: `moetrain train --nproc 2` at
parallel.ep=2 x parallel.zero_stage=3 (dense weights FSDP-sharded over the 2 data-parallel ranks,
experts split over ep), trained once for both tests:

- resumed from the checkpoint of its step 3 (the trainer on forked gloo ranks, what each rank of
  the command runs), a run continues with exactly the losses of the run that saved it;
- its export gathers every expert: ``moetrain convert RUN --to-hf`` equals, bit for bit, the export
  of the same weights at world 1, where the checkpoint is first consolidated by the training
  code's own loader into a plain single-process model (``load_model_weights`` +
  ``load_state_dict``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses

ROOT = Path(__file__).resolve().parents[2]
ZERO3_EP2 = ("--parallel.zero_stage=3", "--train.deterministic=true", "--checkpoint.every=3",
             # SwiGLU everywhere: the export then holds every kind of expert tensor (w1, w3, w2).
             "--moe.activation=swiglu", "--model.activation=swiglu", "--moe.top_k=2")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "moetrain.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _train(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    return _cli("train", "--nproc", "2", *job_overrides(run_dir, steps=steps, ep=2, extra=ZERO3_EP2))


@pytest.fixture(scope="module")
def ref(tmp_path_factory, shakespeare_cached) -> Path:
    """The run directory of 6 steps at ep=2 x ZeRO-3, checkpointed at steps 3 and 6."""
    run = tmp_path_factory.mktemp("zero3") / "ref"
    proc = _train(run, steps=6)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_ep2_resume_through_the_cli_is_exact(tmp_path, ref):
    want = read_losses(ref)
    assert len(want) == 6
    saved = ref / "checkpoints" / "step_000000003"
    manifest = (saved / "manifest.json").read_text()
    assert '"zero_stage": 3' in manifest and '"ep": 2' in manifest

    run = tmp_path / "run"
    shutil.copytree(saved, run / "checkpoints" / saved.name)
    # checkpoint.resume=auto: continues from step 3
    resumed_from = run_ranks(_resume, 2, job_overrides(run, steps=6, ep=2, extra=ZERO3_EP2), timeout_s=300)
    assert resumed_from == [run / "checkpoints" / saved.name] * 2
    # FSDP's reduce-scatter over gloo sums in a fixed order and the resumed run starts from the
    # same bits (weights, Adam moments, data position, RNG), so the losses match exactly.
    assert read_losses(run) == want[3:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_an_ep2_zero3_run_equals_the_world1_export(tmp_path, ref):
    from moetrain.cli import main
    from moetrain.interop.export import build_model, write_export
    from moetrain.interop.hf import export_hf
    from moetrain.models.transformer import Transformer
    from moetrain.train.checkpoint.files import latest_checkpoint
    from moetrain.train.checkpoint.index import load_model_weights
    from moetrain.utils.safetensors_io import SafetensorsFolder

    ckpt = latest_checkpoint(ref / "checkpoints")
    assert '"zero_stage": 3' in (ckpt / "manifest.json").read_text()

    assert main(["convert", str(ref), "--to-hf", str(tmp_path / "from_run")]) == 0  # a file conversion: in-process

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
    init = Transformer(model.config, moe=model.moe_config, seed=state["config"]["train"]["seed"]).state_dict()
    name = "layers.1.feed_forward.experts.w2"
    assert not torch.equal(init[name], model.state_dict()[name])


def _resume(rank: int, world_size: int, overrides: list[str]) -> Path | None:
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return None if trainer.resumed_from is None else Path(trainer.resumed_from)
