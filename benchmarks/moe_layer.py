"""Forward+backward time of the MoE layer against the ideal: the same active FLOPs as plain
dense matmuls (T*K rows through one expert-sized FFN, forward and backward).

    python benchmarks/moe_layer.py [--json] [--shapes A,B] [--runs 10]
    python benchmarks/moe_layer.py --device cuda --dtype bfloat16 --shapes A,B,M

The layer and the ideal are timed alternately (layer, ideal, layer, ideal, ...) so machine drift
cancels in the ratio; efficiency = median over runs of ideal_ms / layer_ms. The loop path gets its
own alternating series against the ideal (loop_efficiency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer
from moetrain.utils.cpu_allocator import tune_cpu_allocator

SHAPES = {
    # name: (T tokens, D, F, E, K, activation)
    "A": (4096, 512, 1024, 8, 2, "gelu"),      # classic
    "B": (4096, 512, 256, 64, 8, "gelu"),      # fine-grained
    "M": (16384, 4096, 14336, 8, 2, "swiglu"),  # Mixtral-like, GPU only
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, grads_of=()) -> float:
    # As in a training step after optimizer.zero_grad(set_to_none=True): backward writes fresh
    # gradients instead of adding into old ones (outside the timed region, for both sides).
    for t in grads_of:
        t.grad = None
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def bench_shape(name: str, *, device: torch.device, dtype: torch.dtype, runs: int, warmup: int,
                with_loop: bool) -> dict:
    T, D, Fh, E, K, act = SHAPES[name]
    torch.manual_seed(0)
    cfg = {"num_experts": E, "top_k": K, "expert_hidden_dim": Fh, "activation": act}
    layer = MoELayer(D, MoEConfig(**cfg, expert_impl="grouped")).to(device=device, dtype=dtype)
    loop = MoELayer(D, MoEConfig(**cfg, expert_impl="loop")).to(device=device, dtype=dtype)
    loop.load_state_dict(layer.state_dict())
    x_TD = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    g_TD = torch.randn(T, D, device=device, dtype=dtype)

    # The ideal: one expert-sized FFN over all T*K routed rows, same FLOPs as the experts.
    x_ND = torch.randn(T * K, D, device=device, dtype=dtype, requires_grad=True)
    g_ND = torch.randn(T * K, D, device=device, dtype=dtype)
    w1 = (torch.randn(D, Fh, device=device, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(Fh, D, device=device, dtype=dtype) * 0.02).requires_grad_()
    w3 = (torch.randn(D, Fh, device=device, dtype=dtype) * 0.02).requires_grad_() if act == "swiglu" else None

    def run_layer(m):
        def f():
            out, aux = m(x_TD)
            torch.autograd.backward([out, aux.loss], [g_TD, torch.ones_like(aux.loss)])
        return f

    def run_ideal():
        h = F.silu(x_ND @ w1) * (x_ND @ w3) if w3 is not None else F.gelu(x_ND @ w1)
        (h @ w2).backward(g_ND)

    grads_of = [x_TD, x_ND, w1, w2, *([w3] if w3 is not None else []), *layer.parameters(), *loop.parameters()]

    def alternate(fn) -> tuple[list[float], list[float]]:
        """(fn times, ideal times), measured fn, ideal, fn, ideal, ... after warm-up."""
        fns = [fn, run_ideal]
        for _ in range(warmup):
            for f in fns:
                f()
        times = tuple([] for _ in fns)
        for _ in range(runs):
            for f, t in zip(fns, times, strict=True):
                t.append(_timed(f, device, grads_of))
        return times

    def ratio(ideal_ms, ms) -> float:
        return statistics.median(i / t for i, t in zip(ideal_ms, ms, strict=True))

    layer_ms, ideal_ms = alternate(run_layer(layer))
    loop_ms, loop_ideal_ms = alternate(run_layer(loop)) if with_loop else (None, None)
    return {
        "shape": name,
        "layer_ms": round(statistics.median(layer_ms), 2),
        "loop_ms": round(statistics.median(loop_ms), 2) if with_loop else None,
        "ideal_ms": round(statistics.median(ideal_ms), 2),
        "efficiency": round(ratio(ideal_ms, layer_ms), 3),
        "loop_efficiency": round(ratio(loop_ideal_ms, loop_ms), 3) if with_loop else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shapes", default="A,B")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert loop path")
    p.add_argument("--json", action="store_true", help="one JSON object per shape")
    p.add_argument("--no-tune-allocator", action="store_true",
                   help="leave glibc's allocator as it is (the layer and the ideal both pay page faults)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.device == "cpu" and not a.no_tune_allocator:
        tune_cpu_allocator()  # what `moetrain train` does on CPU; see moetrain/utils/cpu_allocator.py
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    for name in a.shapes.split(","):
        r = bench_shape(name, device=device, dtype=dtype, runs=a.runs, warmup=a.warmup, with_loop=not a.no_loop)
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            T, D, Fh, E, K, act = SHAPES[name]
            print(f"shape {name} (T={T} D={D} F={Fh} E={E} K={K} {act}, {a.dtype} on {a.device}): "
                  f"layer {r['layer_ms']} ms, loop {r['loop_ms']} ms, ideal {r['ideal_ms']} ms, "
                  f"efficiency {r['efficiency']:.3f} (loop {r['loop_efficiency']})", flush=True)


if __name__ == "__main__":
    main()
