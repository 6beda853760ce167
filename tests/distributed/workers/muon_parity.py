"""Muon on gloo ranks: the ZeRO parity harness (``zero_parity``: same model, seed and global batch,
the trainer's step written out) with ``build_optimizer(name="muon")`` in place of AdamW, against one
plain process; the momenta are returned too (ZeRO-1's consolidated, as a checkpoint saves them).
And the ``Trainer`` with optim.name muon (``trainer_worker``), for the exact-resume check."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moetrain.distributed import ParallelDims, parallelize, wrap_optimizer
from moetrain.distributed.data_parallel.zero1 import ZeroShardedOptimizer
from moetrain.train.optim import build_optimizer
from tests.distributed.workers.zero_parity import (
    GLOBAL_BATCH,
    Run,
    _full,
    _mean_over_ranks,
    _train,
    build,
    model_configs,
)


def muon_optimizer(model):
    return build_optimizer(model, name="muon", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def momenta(model, optimizer) -> dict[str, torch.Tensor]:
    """The whole momentum buffer of every Muon parameter, by name (collective under sharding)."""
    plain = optimizer.consolidated() if isinstance(optimizer, ZeroShardedOptimizer) else optimizer
    return {name: _full(plain.state[p]["momentum_buffer"]).clone() for name, p in model.named_parameters()
            if "momentum_buffer" in plain.state.get(p, {})}


def run_reference(run: Run) -> dict:
    model = build(run)
    opt = muon_optimizer(model)
    losses, norms = _train(run, model, model, opt, rows=lambda batch: batch)
    return {"loss": losses, "grad_norm": norms, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "momenta": momenta(model, opt)}


def muon_worker(rank: int, world_size: int, runs: list[Run]) -> dict:
    out = {}
    B = GLOBAL_BATCH // world_size
    for run in runs:
        dims = ParallelDims(world_size=world_size, ep=run.ep, num_experts=model_configs(run)[1].num_experts)
        dims.build_mesh("cpu")
        model = build(run)
        train_model = parallelize(model, dims, zero_stage=run.zero_stage)
        opt = wrap_optimizer(muon_optimizer(model), dims, zero_stage=run.zero_stage)
        losses, norms = _train(run, model, train_model, opt, rows=lambda batch: batch[rank * B:(rank + 1) * B],
                               mean_loss=lambda loss: _mean_over_ranks(loss, world_size))
        full = {k: _full(v).detach().clone() for k, v in model.named_parameters()}
        mom = momenta(model, opt)
        out[run.name] = {"loss": losses, "grad_norm": norms, "params": full if rank == 0 else None,
                         "momenta": mom if rank == 0 else None}
        del model, train_model, opt
    return out


def trainer_worker(rank: int, world_size: int, run_dir: Path, data: Path, overrides: list[str]) -> list[float]:
    """A 4-step Trainer run with optim.name muon and checkpoints at steps 2 and 4 (``overrides`` on
    top); rank 0 returns the losses it logged. The trainer ends the process group when it closes:
    one run per launch."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, [
        "--model.dim=32", "--model.num_layers=2", "--model.num_heads=2", "--model.max_seq_len=32",
        "--moe.num_experts=4", "--moe.top_k=2", "--moe.expert_hidden_dim=32", "--moe.collapse_threshold=0.6",
        "--optim.name=muon", "--optim.warmup_steps=1", "--data.corpus=path", f"--data.path={data}",
        "--data.tokenizer=bytes", "--data.seq_len=16", "--data.val_fraction=0.1", "--train.global_batch_size=4",
        "--train.micro_batch_size=2", "--train.device=cpu", "--train.steps=4", "--train.eval_every=0",
        "--checkpoint.every=2", f"--log.run_dir={run_dir}", "--log.every=1", "--log.progress_bar=false",
        "--log.tensorboard=false", *overrides]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]
