"""Measure this machine once for the step-time model (``moetrain.plan.step_time``).

    python -m moetrain.plan.calibrate --out runs/calibration.json            # the demo's config, 1 2 4 procs
    python -m moetrain.plan.calibrate --config mixtral-mini --procs 1 2 --out cal.json

For each process count n of ``--procs``, n real processes start together (spawn, gloo, a file
rendezvous), each with the threads a rank of ``moetrain train --nproc n`` gets (OMP_NUM_THREADS =
cores // n, at least 1), and measure the same things at the same time, so that a rank's rates are
those it has beside n - 1 others: 4 ranks on 2 cores share them, and the rates say by how much.

1. peak: a 1024^3 fp32 matmul (the trainer's MFU denominator on CPUs, ``train.flops``);
2. dense GEMMs at the config's shapes for the micro-batch n ranks run: each projection of a block
   and the head, forward and both backward products;
3. expert GEMMs: ``grouped_matmul`` over the E/n local experts (E when n does not divide E), the
   micro-batch's T*K routed copies spread evenly, forward and both backward products;
4. attention: causal ``scaled_dot_product_attention`` forward + backward at [B, H, S, A];
5. elementwise bandwidth: the model's memory-bound kernels at its shapes (an RMSNorm, gelu and its
   backward, a row permutation; apart, log-softmax over the vocabulary and its backward), nominal
   bytes read + written over their time, mixed as the head's and the blocks' saved activations are;
6. optimizer bandwidth: an AdamW step (as ``train.optim`` builds it) and global-norm clipping over
   the model's parameters, ``OPTIMIZER_BYTES_PER_ELEMENT`` per element over their time;
7. (n > 1) all_reduce, all_to_all_single, all_gather_single and reduce_scatter_single at 4 KiB
   and 16 MiB: latency = the small call's time, bandwidth = extra bytes sent / extra time;
8. (n > 1) overlap: an async all-reduce started before a matmul of about its duration, against the
   two run one after the other;
9. host cost per operation: the config's model at small widths (``plan.host_ops``), whose step is
   nearly all dispatch, one micro-batch and an optimizer step, over the operations they dispatch;
10. (n > 1, E divisible by n) expert parallelism's host work: that small model as the trainer runs it
   at dp = n, at ep = n against ep = 1: the micro-batches' difference less the all-to-alls' latency
   per MoE layer (``ep_layer_host_s``), the optimizer steps' less the experts' norm all-reduce per
   expert DTensor (``dtensor_param_host_s``).

The ranks' medians are averaged; the JSON holds one "cpu" ``DeviceProfile`` per n.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moetrain.plan.step_time import ATTENTION_BACKWARD_RATIO, OPTIMIZER_BYTES_PER_ELEMENT

SMALL_BYTES, LARGE_BYTES = 4 << 10, 16 << 20
ROUND_S = 0.2
"""Seconds of one timed round: long against a scheduler time slice and a barrier."""
NO_LINK_BANDWIDTH = 1e18
"""The link of a one-process profile, which never communicates (JSON has no infinity)."""


def _timeit(fn, *, repeats: int, barrier) -> float:
    """Seconds per call of ``fn`` as the slowest rank sees it: the ranks start a round of the same
    number of calls together and it ends when the last one is done (a synchronous step waits for
    it too); rounds of about ``ROUND_S``, so that ranks sharing cores get their scheduler share;
    the median of ``repeats`` rounds, after a warm-up call."""
    import torch
    import torch.distributed as dist

    fn()
    t0 = time.perf_counter()
    fn()
    calls = torch.tensor([max(1, math.ceil(ROUND_S / max(time.perf_counter() - t0, 1e-7)))])
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # every rank makes the same calls
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        for _ in range(int(calls)):
            fn()
        barrier()
        times.append((time.perf_counter() - t0) / int(calls))
    return statistics.median(times)


def _gemm_rates(cfg, procs: int, *, repeats: int, barrier) -> dict:
    """FLOP/s of the dense and expert GEMMs and of attention at ``cfg``'s shapes."""
    import torch

    from moetrain.models.moe.experts import grouped_matmul
    from moetrain.plan.planner import planned_micro_batch, resolve_vocab

    model, moe = resolve_vocab(cfg), cfg.moe
    micro, _, _ = planned_micro_batch(cfg.train, procs)
    T, D, S, A = micro * cfg.data.seq_len, model.dim, cfg.data.seq_len, model.resolved_head_dim
    shapes = [(D, model.num_heads * A), (D, model.resolved_num_kv_heads * A), (D, model.resolved_num_kv_heads * A),
              (model.num_heads * A, D), (D, model.resolved_vocab_size)]
    if any(not model.is_moe_layer(i) for i in range(model.num_layers)):
        shapes += [(D, model.resolved_dense_hidden_dim), (model.resolved_dense_hidden_dim, D)]
    mats = [(torch.randn(T, i), torch.randn(i, o), torch.randn(T, o)) for i, o in shapes]

    def dense() -> None:
        for x, w, g in mats:  # forward, input gradient, weight gradient
            x @ w, g @ w.t(), x.t() @ g

    dense_flops = sum(3 * 2 * T * i * o for i, o in shapes)
    out = {"peak": _peak(repeats=repeats, barrier=barrier),
           "dense": dense_flops / _timeit(dense, repeats=repeats, barrier=barrier)}
    if model.is_moe:
        E = moe.num_experts // procs if moe.num_experts % procs == 0 else moe.num_experts
        N, F = T * moe.top_k, moe.expert_hidden_dim
        offsets = torch.arange(1, E + 1, dtype=torch.int32) * (N // E)
        w_up, w_down = torch.randn(E, D, F), torch.randn(E, F, D)
        x_ND, h_NF = torch.randn(N // E * E, D), torch.randn(N // E * E, F)

        def experts() -> None:
            for x, w, g in ((x_ND, w_up, h_NF), (h_NF, w_down, x_ND)):
                grouped_matmul(x, w, offsets), grouped_matmul(g, w.transpose(-2, -1), offsets)
                torch._grouped_mm(x.t(), g, offs=offsets)  # the weight gradient

        out["expert"] = 3 * 2 * (N // E * E) * 2 * D * F / _timeit(experts, repeats=repeats, barrier=barrier)
    q = torch.randn(micro, model.num_heads, S, A, requires_grad=True)
    k, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)

    def attention() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    attn_flops = (1 + ATTENTION_BACKWARD_RATIO) * 2 * S * model.num_heads * A * T  # step_time's count
    out["attention"] = attn_flops / _timeit(attention, repeats=repeats, barrier=barrier)
    return out


def _peak(*, repeats: int, barrier) -> float:
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / _timeit(lambda: a @ b, repeats=repeats, barrier=barrier)


def _elementwise_bandwidth(cfg, procs: int, *, repeats: int, barrier) -> float:
    """Bytes/s (read + written) of the model's memory-bound kernels at its shapes: the loss's
    log-softmax and the blocks' kernels timed apart, mixed as the config's saved activations are
    (``plan.activations``: the head's share and the blocks')."""
    import torch
    import torch.nn.functional as F

    from moetrain.plan.activations import estimate_activations
    from moetrain.plan.planner import planned_micro_batch, resolve_vocab

    model, moe = resolve_vocab(cfg), cfg.moe
    micro, _, _ = planned_micro_batch(cfg.train, procs)
    T, D, V = micro * cfg.data.seq_len, model.dim, model.resolved_vocab_size
    N, H = T * moe.top_k, moe.expert_hidden_dim if model.is_moe else model.resolved_dense_hidden_dim
    x_TD, w_D = torch.randn(T, D), torch.randn(D)
    h_NH, g_NH = torch.randn(N, H), torch.randn(N, H)
    logits_TV = torch.randn(T, V)
    order_N = torch.randperm(N) % T

    def blocks() -> None:
        x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + 1e-5) * w_D  # RMSNorm: ~8 passes of T*D
        F.gelu(h_NH)  # read + write
        torch.ops.aten.gelu_backward(g_NH, h_NH)  # read 2, write 1
        x_TD.index_select(0, order_N)  # gather N rows: read + write N*D

    def head() -> None:
        lsm = F.log_softmax(logits_TV, dim=-1)  # read + write
        torch.ops.aten._log_softmax_backward_data(logits_TV, lsm, -1, torch.float32)  # read 2, write 1

    block_bw = 4 * (8 * T * D + 5 * N * H + 2 * N * D) / _timeit(blocks, repeats=repeats, barrier=barrier)
    head_bw = 4 * 5 * T * V / _timeit(head, repeats=repeats, barrier=barrier)
    terms = estimate_activations(model, moe, micro_batch_size=micro, seq_len=cfg.data.seq_len,
                                 dtype=cfg.train.dtype).terms
    head_bytes, block_bytes = terms["head"], sum(v for k, v in terms.items() if k != "head")
    return (head_bytes + block_bytes) / (head_bytes / head_bw + block_bytes / block_bw)


def _optimizer_bandwidth(cfg, *, repeats: int, barrier) -> float:
    """Bytes/s of AdamW + clipping over the model's parameters, at ``OPTIMIZER_BYTES_PER_ELEMENT``."""
    import torch

    from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
    from moetrain.distributed.local_adamw import LocalAdamW
    from moetrain.plan.model_states import param_specs
    from moetrain.plan.planner import resolve_vocab

    params: list[torch.Tensor] = [torch.nn.Parameter(torch.randn(s.shape))
                                   for s in param_specs(resolve_vocab(cfg), cfg.moe)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = LocalAdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # as train.optim builds it

    def step() -> None:
        clip_global_grad_norm_(params, 1.0)  # as the trainer clips
        opt.step()

    numel = sum(p.numel() for p in params)
    return OPTIMIZER_BYTES_PER_ELEMENT * numel / _timeit(step, repeats=repeats, barrier=barrier)


def _op_overhead(cfg, *, repeats: int, barrier) -> float:
    from moetrain.plan.host_ops import count_host_ops, small_step
    from moetrain.plan.planner import resolve_vocab

    model = resolve_vocab(cfg)
    micro_batch, optimizer_step = small_step(model, cfg.moe)

    def step() -> None:
        micro_batch()
        optimizer_step()

    return _timeit(step, repeats=repeats, barrier=barrier) / count_host_ops(model, cfg.moe).per_step(1)


def _ep_host(cfg, world: int, *, a2a_latency_s: float, all_reduce_latency_s: float, repeats: int,
             barrier) -> dict:
    """Expert parallelism's host work beyond what the step-time model counts otherwise: the
    config's model at small widths (``plan.host_ops``), as the trainer runs it at dp = ``world``,
    once at ep = ``world`` and once at ep = 1; the difference of their micro-batches, less the
    all-to-alls' latency, per MoE layer, and of their optimizer steps, less the all-reduce of the
    experts' squared gradient norm over ep (which ep = 1 does not have, and the model counts as a
    sync), per expert DTensor."""
    import torch.distributed as dist

    from moetrain.plan.comm import num_moe_layers
    from moetrain.plan.host_ops import parallel_small_step
    from moetrain.plan.model_states import param_specs
    from moetrain.plan.planner import resolve_vocab
    from moetrain.plan.step_time import all_to_alls_per_moe_layer

    model = resolve_vocab(cfg)
    num_moe = num_moe_layers(model)  # the small model's multi-token depths are MoE layers too
    if not model.is_moe or cfg.moe.num_experts % world != 0:
        return {}
    times = {}
    for ep in (1, world):
        micro_batch, optimizer_step = parallel_small_step(model, cfg.moe, ep=ep)
        micro_s = _timeit(micro_batch, repeats=repeats, barrier=barrier)  # gradients accumulate
        times[ep] = (micro_s, _timeit(lambda: optimizer_step(zero_grad=False), repeats=repeats,  # noqa: B023
                                      barrier=barrier))
        dist.barrier()
    num_expert_tensors = sum(1 for spec in param_specs(model, cfg.moe) if spec.expert)
    # The small model keeps cfg.moe's chunks, dedup and capacity factor: its layers make the calls counted here.
    layer_s = (times[world][0] - times[1][0]) / num_moe - all_to_alls_per_moe_layer(cfg.moe)[0] * a2a_latency_s
    return {"ep_layer_host_s": max(0.0, layer_s),
            "dtensor_param_host_s": max(0.0, (times[world][1] - times[1][1] - all_reduce_latency_s)
                                        / num_expert_tensors)}


def _collectives(world: int, *, repeats: int, barrier) -> dict:
    """Per collective ``[bandwidth, latency]`` from a small and a large call (bytes this rank sends,
    by the ring formulas of ``plan.comm``)."""
    import torch

    sent = {"all_reduce": 2 * (world - 1) / world, "all_to_all": (world - 1) / world,
            "all_gather": (world - 1) / world, "reduce_scatter": (world - 1) / world}
    out = {}
    for name, fraction in sent.items():
        times = {}
        for nbytes in (SMALL_BYTES, LARGE_BYTES):
            n = nbytes // 4 // world * world
            call = _collective_call(name, torch.randn(n), torch.randn(n // world))
            times[n * 4] = _timeit(call, repeats=repeats, barrier=barrier)
        (small, t_small), (large, t_large) = sorted(times.items())
        out[name] = [fraction * (large - small) / max(t_large - t_small, 1e-9), t_small]
    return out


def _collective_call(name: str, full, part):
    import torch
    import torch.distributed as dist

    from moetrain.distributed.comm.collectives import all_gather_single, reduce_scatter_single

    return {"all_reduce": lambda: dist.all_reduce(full),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
            "all_gather": lambda: all_gather_single(full, part),
            "reduce_scatter": lambda: reduce_scatter_single(part, full)}[name]


def _overlap(*, repeats: int, barrier) -> float:
    """Fraction of an all-reduce that hides behind a matmul of about its duration."""
    import torch
    import torch.distributed as dist

    buf = torch.randn(LARGE_BYTES // 4)
    t_comm = _timeit(lambda: dist.all_reduce(buf), repeats=repeats, barrier=barrier)
    n = 256
    a = torch.randn(n, n)
    t_one = _timeit(lambda: a @ a, repeats=repeats, barrier=barrier)
    count = max(1, round(t_comm / t_one))

    def compute() -> None:
        for _ in range(count):
            a @ a

    t_mm = _timeit(compute, repeats=repeats, barrier=barrier)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_both = _timeit(both, repeats=repeats, barrier=barrier)
    return min(1.0, max(0.0, (t_comm + t_mm - t_both) / min(t_comm, t_mm)))


def _rank_main(rank: int, world: int, threads: int, init_file: str, config: str, repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from moetrain.config.loader import load_config

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = load_config(config, [])
        barrier = dist.barrier
        res = _gemm_rates(cfg, world, repeats=repeats, barrier=barrier)
        res["elementwise_bandwidth"] = _elementwise_bandwidth(cfg, world, repeats=repeats, barrier=barrier)
        res["optimizer_bandwidth"] = _optimizer_bandwidth(cfg, repeats=repeats, barrier=barrier)
        res["op_overhead_s"] = _op_overhead(cfg, repeats=repeats, barrier=barrier)
        if world > 1:
            res["collectives"] = _collectives(world, repeats=repeats, barrier=barrier)
            res["overlap"] = _overlap(repeats=repeats, barrier=barrier)
            res.update(_ep_host(cfg, world, a2a_latency_s=res["collectives"]["all_to_all"][1],
                                all_reduce_latency_s=res["collectives"]["all_reduce"][1], repeats=repeats,
                                barrier=barrier))
        queue.put((rank, res))
    finally:
        dist.destroy_process_group()


def measure(procs: int, *, config: str = "tiny", repeats: int = 5, timeout_s: float = 600.0) -> dict:
    """Start ``procs`` processes that measure together; their results averaged over the ranks."""
    import multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // procs)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [ctx.Process(target=_rank_main, args=(r, procs, threads, os.path.join(tmp, "store"), config,
                                                     repeats, queue)) for r in range(procs)]
        for p in ranks:
            p.start()
        results = [queue.get(timeout=timeout_s)[1] for _ in ranks]
        for p in ranks:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"calibration rank {ranks.index(p)} of {procs} exited with {p.exitcode}")
    merged = {key: statistics.mean(r[key] for r in results) for key in results[0] if key != "collectives"}
    if procs > 1:
        merged["collectives"] = {c: [statistics.mean(r["collectives"][c][i] for r in results) for i in (0, 1)]
                                 for c in results[0]["collectives"]}
    merged["threads_per_rank"] = threads
    merged["procs"], merged["cpu_count"] = procs, os.cpu_count() or 1
    return merged


def profile_from_measurement(m: dict) -> dict:
    """A "cpu" ``DeviceProfile`` (as a dict) from ``measure``'s numbers. The links of one machine:
    inter-node is the same loopback (a CPU bench has one node)."""
    peak = m["peak"]
    coll = m.get("collectives")
    if coll:
        link = {"bandwidth": coll["all_reduce"][0], "latency": coll["all_reduce"][1], "by_collective": coll}
    else:
        link = {"bandwidth": NO_LINK_BANDWIDTH, "latency": 0.0, "by_collective": None}
    return {"name": "cpu", "peak_flops": {"fp32": peak}, "gemm_efficiency": m["dense"] / peak,
            "expert_gemm_efficiency": m.get("expert", m["dense"]) / peak, "attention_efficiency": m["attention"] / peak,
            "memory_bandwidth": m["elementwise_bandwidth"], "optimizer_bandwidth": m["optimizer_bandwidth"],
            "intra_node": link, "inter_node": link, "comm_overlap": m.get("overlap", 1.0), "host_sync_s": 0.0,
            "threads_per_rank": m["threads_per_rank"], "op_overhead_s": m.get("op_overhead_s", 0.0),
            "core_share": min(1.0, m["cpu_count"] / (m["procs"] * m["threads_per_rank"])) if "procs" in m else 1.0,
            "ep_layer_host_s": m.get("ep_layer_host_s", 0.0),
            "dtensor_param_host_s": m.get("dtensor_param_host_s", 0.0)}


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m moetrain.plan.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--config", default="tiny", help="config whose shapes are measured (default: the demo's)")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], help="process counts to measure")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    for n in args.procs:
        if n < 1:
            raise ValueError(f"--procs ({n}) must be >= 1")
    measured, profiles = {}, {}
    for n in args.procs:
        t0 = time.perf_counter()
        measured[n] = measure(n, config=args.config, repeats=args.repeats)
        profiles[n] = profile_from_measurement(measured[n])
        m = measured[n]
        print(f"{n} process(es), {m['threads_per_rank']} thread(s) each: peak {m['peak'] / 1e9:.1f} GFLOP/s, "
              f"dense GEMMs {m['dense'] / 1e9:.1f}, experts {m.get('expert', 0) / 1e9:.1f}, attention "
              f"{m['attention'] / 1e9:.1f}, elementwise {m['elementwise_bandwidth'] / 1e9:.2f} GB/s, optimizer "
              f"{m['optimizer_bandwidth'] / 1e9:.2f} GB/s, {m['op_overhead_s'] * 1e6:.1f} us per operation, ep "
              f"host {m.get('ep_layer_host_s', 0) * 1e3:.2f} ms per MoE layer, "
              f"{m.get('dtensor_param_host_s', 0) * 1e3:.2f} ms per expert DTensor ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    doc = {"machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                       "torch": torch.__version__, "load_average": os.getloadavg(), "config": args.config},
           "measured": {str(n): m for n, m in measured.items()},
           "profiles": {str(n): prof for n, prof in profiles.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
