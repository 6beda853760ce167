"""``moetrain experts``: surgery on a trained MoE's experts (``moetrain.interop.surgery``).

    moetrain experts grow RUN --num-experts 2E --to DIR [--top-k 2K] [--noise 0.01] [--seed 0]
                                                     (copies of a trained MoE's experts, as an export)
"""

from __future__ import annotations

import argparse


def add_parsers(sub) -> None:
    p = sub.add_parser("experts", help="surgery on a trained MoE's experts")
    experts_sub = p.add_subparsers(dest="experts_cmd", required=True)
    grow = experts_sub.add_parser("grow", help="copy each expert (and its router row) into a model with more experts, "
                                       "written as a moetrain export")
    grow.add_argument("source", help="run folder, checkpoint (any layout) or moetrain export")
    grow.add_argument("--num-experts", type=int, required=True,
                      help="experts per MoE layer of the grown model: a multiple of the source's")
    grow.add_argument("--to", required=True, help="output export folder")
    grow.add_argument("--top-k", type=int, default=None,
                      help="moe.top_k of the grown model (default: the source's; scale it by the same factor "
                           "for the same function: moe settings that must change with it are changed and printed)")
    grow.add_argument("--noise", type=float, default=0.0,
                      help="noise on every copy but the first, as a fraction of each tensor's std: a finite "
                           "number >= 0 (default 0)")
    grow.add_argument("--seed", type=int, default=0, help="seed of the noise")
    grow.set_defaults(func=run_grow)


def run_grow(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.interop.surgery import grow_source

    grown = grow_source(args.source, args.to, num_experts=args.num_experts, top_k=args.top_k, noise=args.noise,
                        seed=args.seed)
    out = grown.export
    print(f"grew the experts of {args.source} to {args.num_experts} per MoE layer: export {out}")
    for note in grown.notes:
        print(f"  also changed: {note}")
    print(f"train it: moetrain train --config {out / 'config.yaml'}{_nproc(out)} (a fresh run in {out}-run, weights "
          f"from {out}); from another config: --checkpoint.init_from={out} {' '.join(grown.overrides)}")
    return 0


def _nproc(export) -> str:
    """`` --nproc N`` for the fewest processes the grown config's parallel layout runs on (none at 1)."""
    import math

    import yaml

    p = (yaml.safe_load((export / "config.yaml").read_text()) or {}).get("parallel") or {}
    ep, etp, tp, pp, dp = (int(p.get(k, d)) for k, d in (("ep", 1), ("etp", 1), ("tp", 1), ("pp", 1), ("dp", -1)))
    world = dp * tp * pp if dp != -1 else pp * tp * (ep * etp // math.gcd(ep * etp, tp))
    return f" --nproc {world}" if world > 1 else ""
