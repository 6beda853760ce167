"""Expert parallelism on CPU: forward+backward step time of EP=2 on 2 processes (one thread each)
against the same global work on one process with one thread, and the all-to-all bytes against
the minimum.

    python benchmarks/expert_parallel.py [--json] [--shape A] [--runs 10] [--capacity-factor 1.25]

The EP step is one training step without the optimizer: forward and backward of the MoE layer on
each rank's T/2 tokens, including the all-to-alls and the DDP gradient all-reduce; its time is the
slower rank's median. The single-process step runs the same layer (same seed, so the same global
weights) on all T tokens. ``bytes_ratio`` is (bytes sent + received) / minimum summed over ranks
and steps; 1.00 means the dispatcher moves only the remote token copies and the counts.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from moetrain.config.moe import MoEConfig
from moetrain.distributed import ParallelDims, collect_comm_stats, parallelize
from moetrain.models.moe import MoELayer

SHAPES = {
    # name: (T tokens, D, F, E, K, activation); the shapes of benchmarks/moe_layer.py
    "A": (4096, 512, 1024, 8, 2, "gelu"),
    "B": (4096, 512, 256, 64, 8, "gelu"),
}
EP = 2


def _build(shape: str, capacity_factor: float | None) -> tuple[MoELayer, int, int]:
    T, D, Fh, E, K, act = SHAPES[shape]
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden_dim=Fh, activation=act, capacity_factor=capacity_factor)
    return MoELayer(D, cfg), T, D


def _data(T: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _step(model, x_TD, g_TD) -> None:
    out, aux = model(x_TD)
    torch.autograd.backward([out, aux.loss], [g_TD, torch.ones_like(aux.loss)])


def _single(shape: str, runs: int, warmup: int, capacity_factor: float | None) -> float:
    layer, T, D = _build(shape, capacity_factor)
    x_TD, g_TD = _data(T, D)
    x_TD.requires_grad_()
    times = []
    for i in range(warmup + runs):
        layer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _step(layer, x_TD, g_TD)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ep_rank(rank: int, init_file: str, shape: str, runs: int, warmup: int, capacity_factor, out_q) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=EP)
        dims = ParallelDims(world_size=EP, ep=EP, num_experts=SHAPES[shape][3])
        dims.build_mesh()
        layer, T, D = _build(shape, capacity_factor)
        model = parallelize(layer, dims)
        x_TD, g_TD = _data(T, D)
        rows = slice(rank * T // EP, (rank + 1) * T // EP)
        x_TD, g_TD = x_TD[rows].clone().requires_grad_(), g_TD[rows].clone()
        times = []
        for i in range(warmup + runs):
            layer.zero_grad(set_to_none=True)
            if i == warmup:
                collect_comm_stats(model)  # count the timed steps only
            dist.barrier()  # start together: otherwise a rank's wait for its peer counts as its work
            t0 = time.perf_counter()
            _step(model, x_TD, g_TD)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        stats = collect_comm_stats(model)
        totals = torch.tensor([statistics.median(times), stats.bytes_sent + stats.bytes_received, stats.min_bytes],
                              dtype=torch.float64)
        gathered = [torch.zeros_like(totals) for _ in range(EP)]
        dist.all_gather(gathered, totals)
        if rank == 0:
            buf = io.BytesIO()
            torch.save(torch.stack(gathered), buf)
            out_q.put(buf.getvalue())
    finally:
        dist.destroy_process_group()


def _expert_parallel(shape: str, runs: int, warmup: int, capacity_factor) -> dict:
    ctx = mp.get_context("fork")
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_ep_rank, args=(r, os.path.join(tmp, "store"), shape, runs, warmup,
                                                    capacity_factor, out_q))
                 for r in range(EP)]
        for p in procs:
            p.start()
        per_rank = torch.load(io.BytesIO(out_q.get(timeout=1800)))
        for p in procs:
            p.join()
    return {
        "ep_step_ms": round(per_rank[:, 0].max().item(), 2),
        "bytes_ratio": round(per_rank[:, 1].sum().item() / per_rank[:, 2].sum().item(), 4),
        "a2a_bytes_per_step": int(per_rank[:, 1].sum().item() / runs),
        "min_bytes_per_step": int(per_rank[:, 2].sum().item() / runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="A", choices=sorted(SHAPES))
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args()
    # The EP ranks run first, forked from a parent that has not yet used any intra-op threads.
    result = {"shape": a.shape, "ep": EP, "capacity_factor": a.capacity_factor,
              **_expert_parallel(a.shape, a.runs, a.warmup, a.capacity_factor)}
    torch.set_num_threads(1)
    result["single_step_ms"] = round(_single(a.shape, a.runs, a.warmup, a.capacity_factor), 2)
    result["speedup"] = round(result["single_step_ms"] / result["ep_step_ms"], 3)
    if a.json:
        print(json.dumps(result), flush=True)
    else:
        T, D, Fh, E, K, act = SHAPES[a.shape]
        print(f"shape {a.shape} (T={T} D={D} F={Fh} E={E} K={K} {act}, fp32, gloo): "
              f"EP={EP} step {result['ep_step_ms']} ms vs 1 process {result['single_step_ms']} ms "
              f"(speedup {result['speedup']}), a2a bytes {result['a2a_bytes_per_step']}/step, "
              f"ratio to minimum {result['bytes_ratio']:.2f}", flush=True)


if __name__ == "__main__":
    main()
