"""Inter-node all-to-all bytes, flat vs hierarchical (parallel.ep_hierarchical), measured by the
byte counters of 4 gloo ranks laid out as 2 nodes of 2 (ep = 4), against moetrain plan's estimate.

    python benchmarks/hierarchical.py [--json] [--top-k 2 4] [--tokens 2048] [--runs 3]

One MoE layer of the "tiny" preset (dim 128, E=8, hidden 256) per top_k; each rank runs forward and
backward on its own tokens through the flat exchange and the hierarchical one in turn (same
weights, same tokens), once to warm up, then ``runs`` times each. Bytes are those counted in forward (``CommStats``:
the backward repeats the differentiable exchanges), summed over the ranks, per step; the step
times are medians of the slowest rank (2 CPU cores for 4 ranks: a check that it runs, not a speed).
``plan_ratio`` is the planner's hierarchical / flat inter-node bytes under uniform routing.
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
from dataclasses import replace

import torch
import torch.distributed as dist

from moetrain.config.parallel import ParallelConfig
from moetrain.config.presets import get_preset
from moetrain.distributed import ParallelDims, apply_expert_parallel, collect_comm_stats
from moetrain.models.moe import MoELayer
from moetrain.plan.comm import expected_groups_hit

WORLD, RANKS_PER_NODE = 4, 2
KEYS = ("inter_node_bytes", "inter_node_dispatch_bytes", "intra_node_bytes", "total_bytes", "step_ms")


def _measure(dims: ParallelDims, top_k: int, tokens: int, runs: int, rank: int) -> list[float]:
    preset = get_preset("tiny")
    torch.manual_seed(0)
    layer = MoELayer(preset.model.dim, replace(preset.moe, top_k=top_k))
    model = apply_expert_parallel(torch.nn.Sequential(layer), dims)
    g = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(tokens, preset.model.dim, generator=g).requires_grad_()
    times = []
    for i in range(runs + 1):  # the first is warm-up, neither timed nor counted
        if i == 1:
            collect_comm_stats(model)
        dist.barrier()
        t0 = time.perf_counter()
        out_TD, aux = model(x_TD)
        (out_TD.square().mean() + aux.loss).backward()
        times.append((time.perf_counter() - t0) * 1e3)
    times = times[1:]
    s = collect_comm_stats(model)
    total = s.bytes_sent + s.bytes_received
    return [s.inter_node_bytes / runs, s.inter_node_dispatch_bytes / runs, s.intra_node_bytes / runs, total / runs,
            statistics.median(times)]


def _rank(rank: int, init_file: str, top_ks: list[int], tokens: int, runs: int, out_q) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
        rows = []
        for top_k in top_ks:
            for hierarchical in (False, True):
                dims = ParallelDims.from_config(ParallelConfig(ep=WORLD, ep_hierarchical=hierarchical),
                                                world_size=WORLD, num_experts=8, ranks_per_node=RANKS_PER_NODE)
                dims.build_mesh("cpu")
                rows.append(_measure(dims, top_k, tokens, runs, rank))
        mine = torch.tensor(rows, dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(WORLD)]
        dist.all_gather(every, mine)
        if rank == 0:
            buf = io.BytesIO()
            torch.save(torch.stack(every), buf)
            out_q.put(buf.getvalue())
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--top-k", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON object per top_k")
    a = p.parse_args()
    ctx = mp.get_context("fork")
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), a.top_k, a.tokens, a.runs, out_q))
                 for r in range(WORLD)]
        for proc in procs:
            proc.start()
        per_rank = torch.load(io.BytesIO(out_q.get(timeout=1800)))  # [W, settings, keys]
        for proc in procs:
            proc.join()
    summed, slowest = per_rank.sum(dim=0), per_rank.max(dim=0).values
    num_nodes = WORLD // RANKS_PER_NODE
    for i, top_k in enumerate(a.top_k):
        flat, hier = summed[2 * i], summed[2 * i + 1]
        result = {"top_k": top_k, "num_experts": 8, "ep": WORLD, "nodes": num_nodes, "tokens_per_rank": a.tokens}
        for name, row, times in (("flat", flat, slowest[2 * i]), ("hierarchical", hier, slowest[2 * i + 1])):
            result |= {f"{name}_{k}": int(row[j]) for j, k in enumerate(KEYS[:-1])}
            result[f"{name}_step_ms"] = round(times[-1].item(), 1)
        result["inter_node_ratio"] = round(hier[0].item() / flat[0].item(), 4)
        result["inter_node_dispatch_ratio"] = round(hier[1].item() / flat[1].item(), 4)
        hit = expected_groups_hit(8, top_k, num_nodes) * (num_nodes - 1) / num_nodes
        result["plan_ratio"] = round(hit / (top_k * (num_nodes - 1) / num_nodes), 4)
        if a.json:
            print(json.dumps(result), flush=True)
        else:
            print(f"top_k={top_k}: inter-node bytes/step flat {result['flat_inter_node_bytes']:,} "
                  f"hierarchical {result['hierarchical_inter_node_bytes']:,} (ratio {result['inter_node_ratio']}; "
                  f"dispatch rows {result['inter_node_dispatch_ratio']}, plan {result['plan_ratio']}); "
                  f"intra-node flat {result['flat_intra_node_bytes']:,} hierarchical "
                  f"{result['hierarchical_intra_node_bytes']:,}; step ms flat {result['flat_step_ms']} "
                  f"hierarchical {result['hierarchical_step_ms']}")


if __name__ == "__main__":
    main()
