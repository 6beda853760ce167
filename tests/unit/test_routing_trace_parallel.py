"""The ``counts`` routing trace under parallel layouts (two gloo ranks, the trainer end to end): each
rank's counts of every step equal the bincount of the ids its ``full`` recorder took from the router
in the same run (tp = 2 folded with ep = 2: sequence shards; ep = 2 over dp = 2 with the MoE layers
checkpointed), and under pp = 2 each stage's counts cover the global batch at every step, the first
one (the schedule's shape inference forwards once more) included, in the shares the balancer logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetrain.train.routing_trace_read import TRACE_DIR, read_index, read_tensor, step_file
from moetrain.utils.safetensors_io import read_header
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
STEPS, BATCH, SEQ, TOP_K = 3, 8, 32, 2


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    return ["--model.num_layers=2", "--model.dim=32", "--model.num_heads=2", "--moe.num_experts=4",
            f"--moe.top_k={TOP_K}", "--moe.expert_hidden_dim=32", f"--data.seq_len={SEQ}", f"--train.steps={STEPS}",
            f"--train.global_batch_size={BATCH}", "--train.micro_batch_size=4", "--train.eval_every=0",
            "--train.device=cpu", "--log.every=1", "--log.memory=false", "--log.routing_trace=counts",
            "--checkpoint.save_final=false", "--log.report=false", "--log.progress_bar=false",
            "--log.tensorboard=false", f"--log.run_dir={run_dir}", "--checkpoint.resume=never", *extra]


def trace_job(rank: int, world_size: int, overrides: list[str]) -> None:
    """Trains with the counts trace and, at pp = 1, a ``full`` recorder beside it (in <run_dir>/full)."""
    from moetrain.config.loader import load_config
    from moetrain.train.routing_trace import RoutingRecorder
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config("tiny", overrides))
    try:
        if trainer.pipeline is None:
            counts = trainer.routing.parts[0]
            trainer.routing.parts.append(RoutingRecorder(
                trainer.model, mode="full", every=1, run_dir=trainer.run_dir / "full", geometry=counts.geometry,
                num_micro=trainer.grad_accum, rank=trainer.rank, world_size=world_size, ep=trainer.dims.ep,
                is_main=trainer.is_main, start_step=0))
        trainer.fit()
    finally:
        trainer.close()


def _tensors(folder: Path, step: int, rank: int, prefix: str) -> dict[str, torch.Tensor]:
    path = folder / step_file(step, rank)
    tensors, _ = read_header(path)
    return {k[len(prefix):]: read_tensor(v, path).long() for k, v in tensors.items() if k.startswith(prefix)}


def test_counts_under_tp_ep_and_pp(tmp_path):
    tp_ep, ep_ac, pp = tmp_path / "tp2_ep2", tmp_path / "ep2_ac_moe", tmp_path / "pp2"
    for run_dir, extra in ((tp_ep, ("--parallel.ep=2", "--parallel.tp=2")),
                           (ep_ac, ("--parallel.ep=2", "--train.activation_checkpointing=moe")),
                           (pp, ("--parallel.ep=1", "--parallel.pp=2"))):
        run_ranks(trace_job, 2, _overrides(run_dir, *extra), timeout_s=180)
    for run_dir in (tp_ep, ep_ac):
        for step in range(1, STEPS + 1):
            total = 0
            for rank in range(2):
                counts = _tensors(run_dir / TRACE_DIR, step, rank, "counts.")
                ids = _tensors(run_dir / "full" / TRACE_DIR, step, rank, "ids.")
                assert list(counts) == list(ids) and len(ids) == 2
                for name, ids_TK in ids.items():
                    expected = torch.bincount(ids_TK.reshape(-1), minlength=4)
                    assert torch.equal(counts[name], expected), (run_dir.name, step, rank, name)
                    total += int(counts[name].sum())
            assert total == 2 * BATCH * SEQ * TOP_K, (run_dir.name, step)  # both layers, the global batch
    folder, index = read_index(pp)
    assert index["steps"] == [1, 2, 3] and len(index["layers"]) == 2
    records = [r for r in map(json.loads, (pp / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    for record in records:
        per_layer = {}
        for rank in range(2):
            per_layer.update(_tensors(folder, record["step"], rank, "counts."))
        assert list(per_layer) == index["layers"]
        for i, counts in enumerate(per_layer.values()):
            assert counts.sum() == BATCH * SEQ * TOP_K, (record["step"], i, counts)
            share = [round(v, 5) for v in (counts.double() / counts.sum()).tolist()]
            assert share == record["expert_share"][i], (record["step"], i)
