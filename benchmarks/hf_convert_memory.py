"""Peak memory of a Hugging Face conversion, both ways, against the size of the model.

    .venv/bin/python benchmarks/hf_convert_memory.py [--dim 768] [--experts 8] [--layers 4] [--fused]

1. A random Mixtral-layout moetrain export of a few hundred MB is written tensor by tensor (never
   the whole model in memory).
2. ``moetrain convert EXPORT --to-hf HF`` (moetrain -> HF, per-expert tensors, or fused with
   --fused) runs in a fresh process; then ``moetrain convert --from-hf HF --to BACK`` (HF ->
   moetrain) in another. Each reports its peak RSS (``VmHWM``, reset after the imports through
   ``/proc/self/clear_refs``: Linux) and its RSS before converting (Python, torch and moetrain
   imported: the floor), so the conversion's own peak is the difference. The round trip is checked
   (BACK's tensors equal the export's).

Prints the model's bytes, each direction's peak RSS, the conversion's share of it, and the
ratios to the model size. Bounded streaming shows as a conversion peak of a few tensors (one
layer's expert stack when stacking), independent of the number of layers.
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
import json, sys
import torch
from moetrain.interop.hf import export_hf, import_hf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

# Reset the peak (VmHWM) to the current RSS: imports allocate transiently more than they keep.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
floor = status("VmRSS")
direction, src, out, fused = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if direction == "to_hf":
    report = export_hf(src, out, fused=fused)
else:
    report = import_hf(src, out)
print(json.dumps({"floor": floor, "peak": status("VmHWM"), "bytes": report.num_bytes, "files": report.files}))
"""


def write_random_export(out: Path, *, dim: int, experts: int, layers: int, hidden: int, vocab: int) -> int:
    """A Mixtral-layout export of random weights, written one tensor at a time; returns its bytes."""
    import torch

    from moetrain.config.model import ModelConfig
    from moetrain.config.moe import MoEConfig
    from moetrain.interop.export import export_metadata, write_config_yaml
    from moetrain.interop.hf.convert import _plain, model_state_specs
    from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

    model = ModelConfig(vocab_size=vocab, dim=dim, num_layers=layers, num_heads=dim // 64, num_kv_heads=dim // 128,
                        max_seq_len=1024, activation="swiglu")
    moe = MoEConfig(num_experts=experts, top_k=2, expert_hidden_dim=hidden, activation="swiglu")
    shapes, _ = model_state_specs(model, moe)
    specs = [TensorSpec(n, s, torch.float32) for n, s in shapes.items()]
    g = torch.Generator().manual_seed(0)
    with ShardedWriter(out, specs, metadata=export_metadata({"source": "random"})) as w:
        for spec in specs:
            w.write(spec.name, torch.randn(spec.shape, generator=g) * 0.02)
        w.close()
    write_config_yaml(out, {"model": _plain(model), "moe": _plain(moe)}, {"source": "random"})
    return sum(s.nbytes for s in specs)


def measure(direction: str, src: Path, out: Path, *, fused: bool) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, direction, str(src), str(out), "1" if fused else "0"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--fused", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_bytes = write_random_export(tmp / "export", dim=args.dim, experts=args.experts, layers=args.layers,
                                          hidden=args.hidden, vocab=args.vocab)
        stack = 3 * args.experts * args.dim * args.hidden * 4 // 3  # one layer's w1 (or w3, w2) stack
        to_hf = measure("to_hf", tmp / "export", tmp / "hf", fused=args.fused)
        from_hf = measure("from_hf", tmp / "hf", tmp / "back", fused=False)
        from moetrain.utils.safetensors_io import SafetensorsFolder

        a, b = SafetensorsFolder(tmp / "export"), SafetensorsFolder(tmp / "back")
        import torch

        assert sorted(a.names()) == sorted(b.names()) and all(torch.equal(a.get(n), b.get(n)) for n in a.names())
    mib = 2**20
    print(f"model: {args.layers} layers, dim {args.dim}, {args.experts} experts of {args.hidden}, vocab {args.vocab}: "
          f"{model_bytes / mib:.0f} MiB fp32; one expert stack (w1 of a layer) {stack / mib:.1f} MiB")
    print("| direction | peak RSS | RSS before converting | conversion's own peak | peak / model | own / model |")
    print("|---|---|---|---|---|---|")
    for name, r in ((f"moetrain -> HF ({'fused' if args.fused else 'per-expert'})", to_hf),
                    ("HF -> moetrain", from_hf)):
        own = r["peak"] - r["floor"]
        print(f"| {name} | {r['peak'] / mib:.0f} MiB | {r['floor'] / mib:.0f} MiB | {own / mib:.0f} MiB | "
              f"{r['peak'] / model_bytes:.2f} | {own / model_bytes:.2f} |")
    print("round trip: every tensor equal")


if __name__ == "__main__":
    main()
