"""The optimizer step as the trainer runs it (global-norm clipping, then AdamW) against torch's
per-tensor AdamW with a per-parameter norm and scaling, on a config's model at its real widths, at
world 1 and at ep = 2 (two gloo processes: the experts are DTensors sharded over ep).

Prints per layout the median seconds of each (one run, the same parameters and gradients), their
ratio, and the ATen operations each dispatches per step, counted at the top level (an operation on
a DTensor counts once, before DTensor turns it into local ones). On a GPU every such operation is at
least one kernel launch, so the counts are what carries over from this CPU.

    OMP_NUM_THREADS=1 python benchmarks/optimizer_step.py [--config tiny] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain.config.loader import load_config
from moetrain.distributed import ParallelDims, clip_global_grad_norm_, parallelize
from moetrain.models.transformer import Transformer
from moetrain.plan.host_ops import OpCounter
from moetrain.plan.planner import resolve_vocab
from moetrain.train.optim import build_optimizer, param_groups
from moetrain.utils.tensors import local_tensor


@torch.no_grad()
def _per_tensor_clip(params: list[torch.Tensor], max_norm: float) -> None:
    """The baseline's clipping: each gradient's squared norm, then each gradient scaled, one by one
    (the all-reduce of the sharded part is left out: it is the same collective in both)."""
    sq = torch.zeros(())
    for p in params:
        sq = sq + local_tensor(p.grad).float().pow(2).sum()
    scale = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for p in params:
        local_tensor(p.grad).mul_(scale)


def _median_s(fn, repeats: int) -> float:
    fn()  # AdamW creates its state in the first step
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ops(fn) -> int:
    with OpCounter() as ops:
        fn()
    return ops.count


def _rank(rank: int, world: int, config: str, repeats: int, store: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    cfg = load_config(config, [])
    dims = ParallelDims(world_size=world, ep=world, num_experts=cfg.moe.num_experts)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = Transformer(resolve_vocab(cfg), moe=cfg.moe)
    parallelize(model, dims)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    o = cfg.optim
    ours = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps)
    base = torch.optim.AdamW(param_groups(model, weight_decay=o.weight_decay), lr=o.lr, betas=tuple(o.betas),
                             eps=o.eps, foreach=False)

    def trainer_step() -> None:
        clip_global_grad_norm_(params, o.grad_clip)
        ours.step()

    def baseline_step() -> None:
        _per_tensor_clip(params, o.grad_clip)
        base.step()

    row = {}
    for name, fn in (("per-tensor", baseline_step), ("trainer", trainer_step)):
        row[name] = (_median_s(fn, repeats), _ops(fn))
    if rank == 0:
        out.put(row)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{'layout':8} {'per-tensor ms':>14} {'trainer ms':>11} {'ratio':>6} {'per-tensor ops':>15} "
          f"{'trainer ops':>12}")
    for world in (1, 2):
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_rank, args=(r, world, a.config, a.repeats, os.path.join(tmp, "store"), out))
                     for r in range(world)]
            for p in procs:
                p.start()
            row = out.get(timeout=600)
            for p in procs:
                p.join()
        (base_s, base_ops), (ours_s, ours_ops) = row["per-tensor"], row["trainer"]
        layout = "world 1" if world == 1 else f"ep {world}"
        print(f"{layout:8} {base_s * 1e3:14.2f} {ours_s * 1e3:11.2f} {base_s / ours_s:6.2f} {base_ops:15d} "
              f"{ours_ops:12d}")


if __name__ == "__main__":
    main()
