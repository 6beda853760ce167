"""Communication/computation overlap of the expert-parallel MoE layer: forward+backward of one EP=2
layer (with a shared expert) with the exchanges in one piece (moe.dispatch_chunks=1; the shared
expert still overlaps the dispatch) against C chunks, timed in ONE alternating run (ABAB...).

    python benchmarks/overlap.py [--chunks 4] [--tokens 2048] [--runs 10] [--json]

Each rank (a process with one intra-op thread, gloo) builds both layers from the same seed and
times them in turn on its tokens; a step's time is the slower rank's, the table shows medians. Then
one profiled pass per setting says where the time went, summed over both ranks and the profiled
steps, forward and backward: ``wait`` (``wait_tensor``: blocked on an all-to-all that has not
landed), ``launch`` (issuing them), ``expert GEMM`` (``_grouped_mm``), and from forward hooks
the shared expert's forward. An overlap gain needs the exchange to progress while this thread
computes: on a GPU the NCCL kernels run on their own stream; here gloo's threads need a core
that the two ranks' compute threads already occupy, so ``wait`` is the number to read.
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
from torch.profiler import ProfilerActivity, profile

from moetrain.config.moe import MoEConfig
from moetrain.distributed import ParallelDims, apply_expert_parallel
from moetrain.models.moe import MoELayer

EP = 2
D, F, E, K = 512, 1024, 8, 2
PHASES = {"wait": "wait_tensor", "launch": "all_to_all_single", "expert GEMM": "_grouped_mm"}


def _build(chunks: int, dims: ParallelDims) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden_dim=F, num_shared_experts=1, dispatch_chunks=chunks)
    layer = MoELayer(D, cfg)
    apply_expert_parallel(torch.nn.Sequential(layer), dims)
    return layer


def _step(layer: MoELayer, x_TD: torch.Tensor, g_TD: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    out, aux = layer(x_TD)
    torch.autograd.backward([out, aux.loss], [g_TD, torch.ones_like(aux.loss)])


def _shared_timer(layer: MoELayer) -> list[float]:
    """Forward seconds of the shared expert, appended per call."""
    spent, start = [], []

    def before(*_):
        start.append(time.perf_counter())  # returns None: the input stays

    def after(*_):
        spent.append(time.perf_counter() - start.pop())  # returns None: the output stays

    layer.shared_experts.register_forward_pre_hook(before)
    layer.shared_experts.register_forward_hook(after)
    return spent


def _profile(layer, x_TD, g_TD, steps: int) -> dict[str, float]:
    shared = _shared_timer(layer)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dist.barrier()
            _step(layer, x_TD, g_TD)
    totals = {phase: 0.0 for phase in PHASES}
    for evt in prof.key_averages():
        for phase, key in PHASES.items():
            if key in evt.key:
                totals[phase] += evt.cpu_time_total / 1e3
    totals["shared expert fwd"] = sum(shared) * 1e3
    return totals


def _rank(rank: int, init_file: str, chunks: int, tokens: int, runs: int, warmup: int, out_q) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=EP)
        dims = ParallelDims(world_size=EP, ep=EP, num_experts=E)
        dims.build_mesh()
        layers = {1: _build(1, dims), chunks: _build(chunks, dims)}
        g = torch.Generator().manual_seed(rank)
        x_TD, g_TD = torch.randn(tokens, D, generator=g).requires_grad_(), torch.randn(tokens, D, generator=g)
        times = {c: [] for c in layers}
        for i in range(warmup + runs):
            for c, layer in layers.items():  # A B A B ...: drift on the machine hits both alike
                dist.barrier()  # start together: a rank's wait for its peer is not its work
                t0 = time.perf_counter()
                _step(layer, x_TD, g_TD)
                if i >= warmup:
                    times[c].append((time.perf_counter() - t0) * 1e3)
        phases = {c: _profile(layer, x_TD, g_TD, steps=3) for c, layer in layers.items()}
        result = torch.tensor([times[c] for c in layers], dtype=torch.float64)
        gathered = [torch.zeros_like(result) for _ in range(EP)]
        dist.all_gather(gathered, result)
        all_phases = [None] * EP
        dist.all_gather_object(all_phases, phases)
        if rank == 0:
            buf = io.BytesIO()
            torch.save({"times": torch.stack(gathered).amax(dim=0), "phases": all_phases}, buf)
            out_q.put(buf.getvalue())
    finally:
        dist.destroy_process_group()


def run(chunks: int, tokens: int, runs: int, warmup: int) -> dict:
    ctx = mp.get_context("fork")
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), chunks, tokens, runs, warmup, out_q))
                 for r in range(EP)]
        for p in procs:
            p.start()
        res = torch.load(io.BytesIO(out_q.get(timeout=3600)), weights_only=False)
        for p in procs:
            p.join()
    medians = [statistics.median(row.tolist()) for row in res["times"]]
    phases = {c: {k: round(sum(r[c][k] for r in res["phases"]), 1) for k in res["phases"][0][c]}
              for c in res["phases"][0]}
    return {"tokens_per_rank": tokens, "chunks": chunks, "unchunked_ms": round(medians[0], 2),
            "chunked_ms": round(medians[1], 2), "ratio_chunked_over_unchunked": round(medians[1] / medians[0], 3),
            "phases_ms_3_steps_both_ranks": {f"chunks={c}": p for c, p in phases.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args()
    if a.chunks < 2:
        p.error(f"--chunks ({a.chunks}) must be >= 2: one chunk is the baseline it is compared with")
    result = run(a.chunks, a.tokens, a.runs, a.warmup)
    if a.json:
        print(json.dumps(result), flush=True)
        return
    print(f"EP={EP}, D={D}, F={F}, E={E}, K={K}, 1 shared expert, {a.tokens} tokens per rank, {a.runs} runs, ABAB")
    print(f"| chunks | median fwd+bwd ms (slower rank) |\n|---|---|\n| 1 | {result['unchunked_ms']} |\n"
          f"| {a.chunks} | {result['chunked_ms']} |")
    print(f"ratio chunked / unchunked: {result['ratio_chunked_over_unchunked']}")
    print("where the time went (ms, 3 profiled steps, both ranks summed):")
    for setting, phases in result["phases_ms_3_steps_both_ranks"].items():
        print(f"  {setting}: " + ", ".join(f"{k} {v}" for k, v in phases.items()))


if __name__ == "__main__":
    main()
