"""Mixed precision through the trainer: bf16 autocast and fp16 with dynamic loss scaling train
(small tensors only: bf16/fp16 matmuls are ~100x slower than fp32 on this CPU)."""

from __future__ import annotations

import json
import math

import pytest

from moetrain.config.loader import load_config
from tests.integration.conftest import job_overrides


def _run(tmp_path, dtype: str, steps: int = 6) -> list[dict]:
    from moetrain.train.trainer import Trainer

    overrides = job_overrides(tmp_path / dtype, steps=steps,
                              extra=(f"--train.dtype={dtype}", "--model.dim=32", "--moe.expert_hidden_dim=32",
                                     "--data.seq_len=32", "--optim.lr=1e-2"))
    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    with open(tmp_path / dtype / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_reduced_precision_trains(tmp_path, shakespeare_cached, dtype):
    recs = _run(tmp_path, dtype)
    losses = [r["loss"] for r in recs]
    assert all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-2:]) / 2 < losses[0] - 0.2, losses
    if dtype == "fp16":
        # The scaler ran: the loss scale is reported, and it starts at 2^16 (halved on overflow).
        scales = [r["loss_scale"] for r in recs]
        assert all(s <= 2.0**16 and math.log2(s).is_integer() for s in scales), scales
