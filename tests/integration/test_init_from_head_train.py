"""The pretrain-then-classify route through the Trainer at ep=2 on 2 gloo processes: a classifier run
with ``checkpoint.init_from`` (a language model's export) and ``checkpoint.init_from_new_head`` starts
with every encoder tensor (experts sharded over ep included) equal to the export, its head as its own
seed draws it, and a fresh optimizer; then it trains."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config.loader import load_config
from moetrain.interop.export import write_export
from moetrain.models.transformer import Transformer
from moetrain.train.init_from import HEAD_NAMES
from tests.helpers.dist_launcher import run_ranks
from tests.integration.test_classify import full_params, overrides, records, write_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _start(rank: int, world_size: int, args: list[str]) -> dict | None:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, args))
    try:
        start = full_params(trainer.model)
        fresh_optimizer = all(not s for s in trainer.optimizer.state.values())
        trainer.fit()
    finally:
        trainer.close()
    return {"start": start, "fresh_optimizer": fresh_optimizer, "config": trainer.model_config} if rank == 0 else None


def test_classifier_starts_from_a_language_model_export(tmp_path):
    data = write_data(tmp_path / "data")
    plain = overrides(tmp_path / "plain", data, steps=2, ep=2, micro=4)
    # The classifier's own start (same seed, no export) gives the head values to expect and the model shape.
    own = run_ranks(_start, 2, plain, timeout_s=240)[0]
    lm = Transformer(dataclasses.replace(own["config"], head="lm", num_classes=None, pooling="last", causal=True,
                                         tie_embeddings=False), moe=load_config(None, plain).moe, seed=7)
    export = write_export(tmp_path / "lm", config={}, state_dict=lm.state_dict())
    run = tmp_path / "from_lm"
    got = run_ranks(_start, 2, overrides(run, data, steps=2, ep=2, micro=4, extra=(
        f"--checkpoint.init_from={export}", "--checkpoint.init_from_new_head=true")), timeout_s=240)[0]
    lm_sd = lm.state_dict()
    assert set(got["start"]) == set(own["start"])
    for name, tensor in got["start"].items():
        want = own["start"][name] if name in HEAD_NAMES else lm_sd[name]
        assert torch.equal(tensor, want), name
    assert got["fresh_optimizer"]
    losses = [r["loss"] for r in records(run) if "loss" in r]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))
