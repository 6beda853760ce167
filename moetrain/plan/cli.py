"""``moetrain plan``: print (or ``--json``) the per-rank memory and per-step communication of every
ZeRO stage x expert-parallel degree x offload x activation-checkpointing choice for a config.

    moetrain plan --config mixtral-8x7b --nproc 64 --nodes 8 --device-memory 80GiB
    moetrain plan --config tiny --nproc 2 --json

Wiring in ``moetrain/cli.py``: ``add_plan_parser(sub)`` in ``build_parser`` and
``return run_plan(args, overrides)`` for ``args.cmd == "plan"`` (``--section.field=value``
overrides apply as for ``train``).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="memory and communication of each parallel choice, before launching")
    p.add_argument("--config", default=None,
                   help="YAML config or a shipped config's name (its model, moe, train, data sections are used)")
    p.add_argument("--nproc", type=int, required=True, help="total number of processes (ranks)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the processes are spread over (default 1)")
    p.add_argument("--device-memory", default=None,
                   help="memory per device, e.g. 80GiB or 40GB: rank the choices that fit")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.add_argument("--all", action="store_true", help="list every choice, not the best 20")
    return p


def run_plan(args, overrides=()) -> int:
    from moetrain.config.loader import load_config
    from moetrain.plan.planner import format_plan, make_plan, parse_bytes

    cfg = load_config(args.config, list(overrides))
    device_memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    plan = make_plan(cfg, nproc=args.nproc, nodes=args.nodes, device_memory=device_memory)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(format_plan(plan, top=None if args.all else 20))
    return 0
