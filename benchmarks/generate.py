"""Decoding speed with and without the key/value cache: greedy generation of 256 new tokens after a
16-token prompt on the "tiny" preset (4 blocks of dim 128, 8 experts top-2 in every block,
vocabulary 4096 as in configs/tiny.yaml), timed in ONE alternating run (cached, uncached, cached, ...).

    python benchmarks/generate.py [--new-tokens 256] [--runs 3] [--device cpu|cuda] [--dtype fp32|bf16]
                                  [--threads 1] [--preset tiny]

Uncached is the full forward over the whole sequence per new token (the reference the cache
reproduces), so its cost per token grows with the length; cached runs each new token alone
against the cached keys. The preset's max_seq_len (256) is raised to fit prompt + new tokens: that
only lengthens the rotary table, no weight changes. Weights are the preset's seeded initialisation
(the speed does not depend on training). Printed: median tokens/s over the runs (prefill
included) and of the decoding steps alone, the ratio cached / uncached, and whether both produced
the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from moetrain.config.presets import PRESETS
from moetrain.models.transformer import Transformer
from moetrain.train.generation import generate

PROMPT_TOKENS = 16
VOCAB = 4096


def build(preset: str, *, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> Transformer:
    p = PRESETS[preset]
    cfg = dataclasses.replace(p.model, vocab_size=VOCAB, max_seq_len=max(max_seq_len, p.model.max_seq_len))
    model = Transformer(cfg, moe=p.moe if cfg.is_moe else None, seed=0)
    return model.to(device=device, dtype=dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build(args.preset, max_seq_len=PROMPT_TOKENS + args.new_tokens, device=device, dtype=dtype)
    prompt = torch.randint(1, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)).to(device)

    kinds = {"cached": True, "uncached": False}
    generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=True)  # warm-up: first-call setup
    generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=False)
    total = {k: [] for k in kinds}
    decode = {k: [] for k in kinds}
    ids = {}
    for _ in range(args.runs):
        for kind, use_cache in kinds.items():
            out = generate(model, prompt, max_new_tokens=args.new_tokens, temperature=0, use_cache=use_cache)
            total[kind].append(out.tokens_per_s)
            decode[kind].append(out.decode_tokens_per_s)
            ids[kind] = out.ids_BS
    med = {k: statistics.median(v) for k, v in total.items()}
    med_decode = {k: statistics.median(v) for k, v in decode.items()}
    print(f"preset {args.preset}: {PROMPT_TOKENS}-token prompt + {args.new_tokens} new tokens, greedy, batch 1, "
          f"{args.device} {args.dtype}, {args.threads} thread(s), median of {args.runs} alternating runs")
    print(f"{'':10s} {'tokens/s':>10s} {'decode tokens/s':>16s}")
    for kind in kinds:
        print(f"{kind:10s} {med[kind]:10.1f} {med_decode[kind]:16.1f}")
    print(f"ratio cached / uncached: {med['cached'] / med['uncached']:.2f}x "
          f"(decode steps alone {med_decode['cached'] / med_decode['uncached']:.2f}x)")
    print(f"same tokens with and without the cache: {'yes' if torch.equal(ids['cached'], ids['uncached']) else 'NO'}")


if __name__ == "__main__":
    main()
