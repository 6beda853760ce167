"""The ATen operations and collectives of one compressed 1-bit Adam step (after the warmup), on a
config's model at its real widths, at dp = 2 (two gloo processes; ``--ep 2`` shards the experts).

Every rank gets its own random gradients; one warmup step freezes the variance, and the second
compressed ``step()`` (the first builds the packed layout) runs under ``OpCounter``: top-level
ATen operations, views included (on a GPU every other one is a kernel launch). Collectives are
the ``c10d`` operations among them.

    OMP_NUM_THREADS=1 python benchmarks/onebit_step.py [--config tiny] [--ep 1] [--save state.pt]

``--save PATH`` has rank r write its weights, Adam state and 1-bit residuals after three compressed
steps to PATH.rank<r> (to compare two versions of the exchange bit for bit).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain.config.loader import load_config
from moetrain.distributed import ParallelDims
from moetrain.distributed.data_parallel.ddp import apply_data_parallel, grad_compression_state
from moetrain.distributed.expert_parallel.apply import apply_expert_parallel
from moetrain.models.transformer import Transformer
from moetrain.plan.host_ops import OpCounter
from moetrain.plan.planner import resolve_vocab
from moetrain.train.optim import build_optimizer
from moetrain.utils.tensors import local_tensor

WORLD = 2


class _Counter(OpCounter):
    """``OpCounter`` that also counts the views among the operations (no kernel on a GPU) and the
    collectives (operations of the ``c10d`` namespace)."""

    def __init__(self) -> None:
        super().__init__()
        self.views = 0
        self.collectives: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.views += func.is_view
        if func.namespace == "c10d":
            self.collectives[func.__name__] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _state(model, opt, ddp) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": local_tensor(p).detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"adam/{n}/{k}"] = local_tensor(v).detach().clone()
    out.update({f"residual/{k}": v.clone() for k, v in grad_compression_state(ddp).items()})
    return out


def _rank(rank: int, config: str, ep: int, store: str, save: str | None, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    cfg = load_config(config, [])
    dims = ParallelDims(world_size=WORLD, ep=ep, num_experts=cfg.moe.num_experts)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = Transformer(resolve_vocab(cfg), moe=cfg.moe)
    apply_expert_parallel(model, dims)
    ddp = apply_data_parallel(model, dims, grad_compression="onebit")
    o = cfg.optim
    opt = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                          data_parallel=ddp, onebit_warmup_steps=1)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(100 + rank)

    def step(counter: _Counter | None = None) -> None:
        for p in params:  # this rank's own gradients, as in the local-gradient mode
            p.grad = torch.randn_like(p)
        with counter if counter is not None else contextlib.nullcontext():
            opt.step()

    step()  # the warmup step: the variance freezes
    assert opt.compressing
    step()  # the first compressed step builds the packed layout
    counter = _Counter()
    step(counter)
    step()
    if save:
        torch.save(_state(model, opt, ddp), f"{save}.rank{rank}")
    out.put((rank, {"dp": dims.dp, "ops": counter.count, "views": counter.views,
                    "collectives": dict(counter.collectives), "num_tensors": len(params)}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--save", default=None)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, a.config, a.ep, os.path.join(tmp, "store"), a.save, q))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        rows = dict(q.get(timeout=600) for _ in range(WORLD))
        for p in procs:
            p.join()
    r0 = rows[0]
    print(f"{a.config} dp={r0['dp']} ep={a.ep}: {r0['num_tensors']} parameter tensors; one compressed step: "
          f"{r0['ops']} ATen operations ({r0['views']} of them views), collectives {r0['collectives']}")


if __name__ == "__main__":
    main()
