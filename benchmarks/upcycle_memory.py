"""Time and peak memory of ``moetrain upcycle`` against the size of the dense model and the MoE.

    .venv/bin/python benchmarks/upcycle_memory.py [--dim 512] [--hidden 2048] [--layers 8] [--experts 8]
                                                  [--top-k 2] [--granularity 1] [--noise 0.0]

1. A random dense Llama folder (config.json + model.safetensors) is written tensor by tensor.
2. ``upcycle_hf`` runs in a fresh process, which reports its wall time, its peak RSS (``VmHWM``,
   reset after the imports through ``/proc/self/clear_refs``: Linux) and its RSS before upcycling
   (Python, torch and moetrain imported: the floor), so the upcycle's own peak is the difference.

Prints the dense and MoE bytes, the wall time, the peak over the floor and its ratio to the
largest output tensor (one layer's expert stack ``[E, D, F/G]``) and to the MoE's size. Streaming
shows as a peak of a few expert stacks, independent of the number of layers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
from moetrain.interop.upcycle import upcycle_hf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

# Reset the peak (VmHWM) to the current RSS: imports allocate transiently more than they keep.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
floor = status("VmRSS")
src, out, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
start = time.perf_counter()
report = upcycle_hf(src, out, **kw)
seconds = time.perf_counter() - start
print(json.dumps({"floor": floor, "peak": status("VmHWM"), "bytes": report.num_bytes, "seconds": seconds}))
"""


def write_random_dense(out: Path, *, dim: int, hidden: int, layers: int, vocab: int) -> int:
    """A dense Llama folder of random weights, written one tensor at a time; returns its bytes."""
    import torch

    from moetrain.config.model import ModelConfig
    from moetrain.config.moe import MoEConfig
    from moetrain.interop.hf.convert import model_state_specs
    from moetrain.interop.hf.registry import FAMILIES
    from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

    family = FAMILIES["llama"]
    model = ModelConfig(vocab_size=vocab, dim=dim, num_layers=layers, num_heads=max(1, dim // 64), moe_every=0,
                        dense_hidden_dim=hidden, activation="swiglu", max_seq_len=512)
    moe = MoEConfig(activation="swiglu")
    shapes, _ = model_state_specs(model, moe)
    entries = [e for e in family.tensor_map(model, moe, fused=False) if e.export]
    specs = [TensorSpec(e.hf, shapes[e.mt], torch.float32) for e in entries]
    g = torch.Generator().manual_seed(0)
    with ShardedWriter(out, specs, metadata={"format": "pt"}) as w:
        for spec in specs:
            w.write(spec.name, torch.randn(spec.shape, generator=g) * 0.02)
        w.close()
    (out / "config.json").write_text(json.dumps(family.hf_config_from(model, moe)))
    return sum(s.nbytes for s in specs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--granularity", type=int, default=1)
    p.add_argument("--noise", type=float, default=0.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dense, up = Path(tmp) / "dense", Path(tmp) / "up"
        dense_bytes = write_random_dense(dense, dim=args.dim, hidden=args.hidden, layers=args.layers,
                                         vocab=args.vocab)
        kw = {"num_experts": args.experts, "top_k": args.top_k, "granularity": args.granularity,
              "noise": args.noise}
        run = subprocess.run([sys.executable, "-c", CHILD, str(dense), str(up), json.dumps(kw)], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        r = json.loads(run.stdout.strip().splitlines()[-1])
    stack = args.experts * args.dim * (args.hidden // args.granularity) * 4
    own = r["peak"] - r["floor"]
    mib = 2**20
    print(f"dense {dense_bytes / mib:.0f} MiB -> MoE {r['bytes'] / mib:.0f} MiB ({args.layers} layers, "
          f"{args.experts} experts, G={args.granularity}, noise {args.noise})")
    print(f"upcycle: {r['seconds']:.2f} s, peak RSS {r['peak'] / mib:.0f} MiB (floor {r['floor'] / mib:.0f} MiB, "
          f"own {own / mib:.0f} MiB = {own / stack:.2f} expert stacks of {stack / mib:.0f} MiB, "
          f"{own / r['bytes']:.3f} of the MoE)")


if __name__ == "__main__":
    main()
