"""--init-from-hf converts a Hugging Face folder once per run folder and reuses the conversion
while the folder holds the same model; another model saved at the same path is converted again.
Before, the cache was keyed by path alone and the run trained from the old model's weights."""

from __future__ import annotations

import shutil
import warnings

import torch

from moetrain.interop.export import read_export
from moetrain.interop.hf.train_from import CACHE, init_from_hf_overrides
from tests.helpers.hf_tiny_models import tiny_model


def _init(hf_dir, run_dir) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return init_from_hf_overrides(hf_dir, config=None, overrides=[f"--log.run_dir={run_dir}"])


def test_another_model_at_the_same_path_is_converted_again(tmp_path):
    hf, run = tmp_path / "hf", tmp_path / "run"
    tiny_model("mixtral", seed=0).save_pretrained(hf)
    assert "--moe.num_experts=4" in _init(hf, run)
    weights = run / CACHE / "model.safetensors"
    converted_at = weights.stat().st_mtime_ns
    _init(hf, run)  # the same model: the conversion is reused
    assert weights.stat().st_mtime_ns == converted_at

    shutil.rmtree(hf)
    other = tiny_model("mixtral", seed=7, num_local_experts=6)
    other.save_pretrained(hf)
    assert "--moe.num_experts=6" in _init(hf, run)
    cfg, state, _ = read_export(run / CACHE)
    assert cfg["moe"]["num_experts"] == 6
    assert torch.equal(state["tok_embeddings.weight"], other.model.embed_tokens.weight)
