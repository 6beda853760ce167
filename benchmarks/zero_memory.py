"""Measured vs planned per-rank memory at ZeRO stages 0-3 x ep 1/2 on 2 gloo ranks (CPU).

    .venv/bin/python benchmarks/zero_memory.py            # prints the markdown tables of docs/memory.md

For each preset and layout: two warm-up steps, then one training step (AdamW, fp32, the model
output held through backward as the trainer holds it) under ``MemoryTracker``; the at-rest
model states right after it with ``model_state_bytes``; the planner's numbers for the same
layout. Rank 0 is reported (rank 1 differs only where shards are uneven).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.helpers
from moetrain.config.presets import get_preset
from moetrain.plan.activations import estimate_activations
from moetrain.plan.model_states import Layout, param_specs, rank_state_bytes, unsharded_param_peak_bytes
from tests.helpers.dist_launcher import run_ranks

WORLD, MICRO, SEQ = 2, 4, 256  # 4 sequences of 256 tokens per rank


def presets():
    tiny = get_preset("tiny")
    mix = get_preset("mixtral-8x7b")
    return {
        "tiny (vocab 4096)": (replace(tiny.model, vocab_size=4096, preset=None), tiny.moe),
        "mixtral-8x7b shape at dim 256": (
            replace(mix.model, dim=256, num_layers=4, num_heads=8, num_kv_heads=2, vocab_size=2048,
                    max_seq_len=SEQ, preset=None),
            replace(mix.moe, expert_hidden_dim=896)),
    }


def worker(rank, world, model_cfg, moe, layouts):
    from moetrain.distributed import ParallelDims, parallelize, wrap_optimizer
    from moetrain.models.transformer import Transformer
    from moetrain.train.optim import build_optimizer
    from moetrain.utils.memory import MemoryTracker, model_state_bytes

    out = {}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (3, world * MICRO, SEQ + 1), generator=g)
    for stage, ep in layouts:
        dims = ParallelDims(world_size=world, ep=ep, num_experts=moe.num_experts)
        dims.build_mesh("cpu")
        model = Transformer(model_cfg, moe=moe, seed=0)
        train_model = parallelize(model, dims, zero_stage=stage)
        opt = wrap_optimizer(build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8),
                             dims, zero_stage=stage)
        for step in range(3):
            x = tokens[step, rank * MICRO:(rank + 1) * MICRO]
            tracker = MemoryTracker(train_model, opt) if step == 2 else None
            if tracker is not None:
                tracker.__enter__()
            output = train_model(x[:, :-1], x[:, 1:])
            output.total_loss.backward()
            del output
            opt.step()
            if tracker is not None:
                tracker.__exit__(None, None, None)
            else:
                opt.zero_grad(set_to_none=True)
        out[(stage, ep)] = {"states": model_state_bytes(model, opt), "peaks": tracker.report()}
        del model, train_model, opt
    return out


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main() -> None:
    layouts = [(s, ep) for ep in (1, 2) for s in (0, 1, 2, 3)]
    for name, (model_cfg, moe) in presets().items():
        results = run_ranks(worker, WORLD, model_cfg, moe, layouts, timeout_s=1200)
        specs = param_specs(model_cfg, moe)
        n = sum(s.numel for s in specs)
        print(f"\n### {name}: {n / 1e6:.1f}M parameters, {WORLD} ranks, {MICRO} x {SEQ} tokens per rank "
              "(MiB, rank 0)\n")
        print("| stage | ep | param | grad | optim | = planned | param peak (meas / plan) | grad peak | optim peak "
              "| activation peak (meas / plan) | total peak |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for stage, ep in layouts:
            r = results[0][(stage, ep)]
            st, pk = r["states"], r["peaks"]
            layout = Layout(world=WORLD, ep=ep, zero_stage=stage)
            plan = rank_state_bytes(specs, layout, 0)
            exact = (st["param_bytes"], st["grad_bytes"], st["optim_bytes"]) == (plan.param, plan.grad, plan.optim)
            gathered = plan.param + unsharded_param_peak_bytes(specs, layout, compute_bytes=4)
            act = estimate_activations(model_cfg, moe, micro_batch_size=MICRO, seq_len=SEQ, ep=ep).peak_bytes
            print(f"| {stage} | {ep} | {mib(st['param_bytes'])} | {mib(st['grad_bytes'])} | {mib(st['optim_bytes'])} "
                  f"| {'exact' if exact else 'DIFFERS'} | {mib(pk.param_bytes)} / {mib(gathered)} "
                  f"| {mib(pk.grad_bytes)} | {mib(pk.optim_bytes)} "
                  f"| {mib(pk.activation_peak_bytes)} / {mib(act)} ({act / pk.activation_peak_bytes:.3f}) "
                  f"| {mib(pk.peak_bytes)} |")


if __name__ == "__main__":
    main()
