"""``train.compile`` with ``log.memory`` on (the default): every step runs the compiled blocks.

The memory tracker is a ``TorchDispatchMode``, under which dynamo runs no compiled frame: a
tracked log step would have been the eager model's (its loss, its speed, its memory). Under
compile the trainer logs no mem/* peaks instead. A counting backend stands in for inductor: the
frame skip is dynamo's, before any backend runs."""

from __future__ import annotations

import json

import torch

from moetrain.config.loader import load_config
from moetrain.train.trainer import Trainer
from tests.helpers.compile_calls import count_compiled_calls, fit_counting_calls


def test_compiled_blocks_run_on_every_logged_step(tmp_path, monkeypatch):
    calls: list[int] = []
    count_compiled_calls(monkeypatch, calls)
    torch._dynamo.reset()
    cfg = load_config("tiny", [
        "--parallel.ep=1", "--model.num_layers=2", "--model.dim=32", "--model.num_heads=2",
        "--moe.expert_hidden_dim=32", "--data.seq_len=32", "--train.steps=5", "--train.global_batch_size=2",
        "--train.micro_batch_size=2",
        "--train.eval_every=0", "--train.compile=true", "--log.every=1", "--log.memory=true",
        "--checkpoint.save_final=false", "--log.report=false", "--log.progress_bar=false", "--log.tensorboard=false",
        f"--log.run_dir={tmp_path}", "--checkpoint.resume=never"])
    try:
        per_step = fit_counting_calls(Trainer(cfg), calls)
    finally:
        torch._dynamo.reset()
    assert len(per_step) == 5 and min(per_step) > 0 and len(set(per_step)) == 1, per_step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    assert not any(k.startswith("mem/") for r in records for k in r), "a mem/* peak means a tracked (eager) step"
