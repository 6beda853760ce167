"""Multi-token prediction on gloo ranks: the ZeRO and tensor-parallel parity harnesses
(``zero_parity``, ``tp_parity``) with ``model.mtp_depth`` set, so the ranks' losses, gradient norms
and final parameters (the modules' included) are compared with one plain process; then a short
``Trainer`` run at the same world size for the per-depth metrics it logs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.workers.tp_parity import TpRun, tp_worker
from tests.distributed.workers.zero_parity import Run, zero_worker


def mtp_worker(rank: int, world_size: int, runs: list[Run], run_dir: Path, data: Path, overrides: list[str],
               tp_runs: list[TpRun]) -> dict:
    out = zero_worker(rank, world_size, runs)
    out.update(tp_worker(rank, world_size, tp_runs))
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, [
        "--model.dim=32", "--model.num_layers=2", "--model.num_heads=2", "--model.max_seq_len=32",
        "--moe.num_experts=4", "--moe.top_k=2", "--moe.expert_hidden_dim=32",
        "--data.corpus=path", f"--data.path={data}", "--data.tokenizer=bytes", "--data.seq_len=16",
        "--data.val_fraction=0.1", "--train.global_batch_size=4", "--train.micro_batch_size=2",
        "--train.device=cpu", "--train.steps=2", "--train.eval_every=0", "--checkpoint.every=0",
        "--checkpoint.save_final=false", f"--log.run_dir={run_dir}", "--log.every=1", "--log.progress_bar=false",
        "--log.tensorboard=false", *overrides]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    if rank == 0:
        out["trainer"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out
