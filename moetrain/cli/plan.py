"""``moetrain plan``: print (or ``--json``) the per-rank memory and per-step communication of every
ZeRO stage x expert-parallel degree x offload x activation-checkpointing choice for a config.

    moetrain plan --config mixtral-8x7b --nproc 64 --nodes 8 --device-memory 80GiB
    moetrain plan --config tiny --nproc 2 --json
    moetrain plan --config deepseek-v3 --nproc 1024 --dry-run [--rank R]
    moetrain plan --config mixtral-8x7b --nproc 64 --nodes 8 --device-profile h100    (+ step time)
    moetrain plan --config tiny --nproc 4 --parallel.ep=4 --skew zipf:1.2 --device-memory 1GiB [--dry-run]
    moetrain plan --config tiny --nproc 4 --parallel.ep=4 --routing-trace runs/demo

``--skew`` / ``--routing-trace`` plan the config's own layout under that routing skew (``plan.skew``):
each rank's routed copies, the hottest rank's memory and the step time, dropless, under capacity
factors and with spare expert slots, and the setting to use; with ``--dry-run`` the receive rows
the plan assumed are checked against the trainer's own forced draw (the micro-batches of its first
steps up to a bound on the uniforms drawn, ``plan.skew_check``).

``--dry-run`` builds one rank for real on the meta device under a fake process group of world
``--nproc`` and prints its counted model-state bytes next to the planner's (``dry_run``).
``--section.field=value`` overrides apply as for ``train``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"80GiB"`` -> 85899345920; ``"80GB"`` -> 8e10; a plain number is bytes (a fraction of a byte
    rounds down). ``ValueError`` for anything else, and for a size under 1 byte: a device without
    memory fits nothing."""
    if isinstance(text, int) and not isinstance(text, bool):
        num_bytes = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"--device-memory ({text!r}) must be a size like 80GiB, 40GB or 512MiB")
        num_bytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if num_bytes < 1:
        raise ValueError(f"--device-memory ({text!r}) must be > 0 and at least 1 byte once parsed "
                         f"(it is {num_bytes} bytes)")
    return num_bytes


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="memory and communication of each parallel choice, before launching")
    p.add_argument("--config", default=None,
                   help="YAML config or a shipped config's name (its model, moe, train, data sections are used)")
    p.add_argument("--nproc", type=int, required=True, help="total number of processes (ranks)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the processes are spread over (default 1)")
    p.add_argument("--device-memory", default=None,
                   help="memory per device, e.g. 80GiB or 40GB: rank the choices that fit")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.add_argument("--all", action="store_true", help="list every choice, not the best 20")
    p.add_argument("--dry-run", action="store_true",
                   help="build one rank of the config's own layout (parallel.ep, parallel.zero_stage) on the meta "
                        "device under a fake process group of --nproc ranks; print its counted parameter, gradient "
                        "and optimizer bytes next to the planner's")
    p.add_argument("--rank", type=int, default=None,
                   help="with --dry-run: the rank to build (default: the largest-memory rank)")
    p.add_argument("--device-profile", default=None,
                   help="h100, h200 or a calibration file: add the estimated step time, tokens/s and MFU of "
                        "each choice and rank the choices by it (docs/step-time.md)")
    p.add_argument("--calibrate", default=None, metavar="FILE",
                   help="measure this machine first (GEMM rates, gloo bandwidth at the ranks per node), write "
                        "FILE and use it as the device profile")
    p.add_argument("--skew", default=None, metavar="SPEC",
                   help="plan the config's layout under this routing skew (moe.force_skew's grammar: zipf:S, "
                        "hot:K:FRACTION, drift:S:PERIOD, trace:PATH): per-rank copies, memory and step time "
                        "dropless, under capacity factors and with spare expert slots (docs/step-time.md)")
    p.add_argument("--routing-trace", default=None, metavar="RUN_DIR",
                   help="as --skew, with the per-expert loads a run recorded (log.routing_trace)")
    p.add_argument("--capacity-factors", default="1.0,1.25,1.5,2.0",
                   help="with --skew/--routing-trace: the capacity factors to plan (comma-separated)")
    p.add_argument("--spare-slots", default=None,
                   help="with --skew/--routing-trace: spare expert slots per rank to plan (comma-separated; "
                        "each at most num_experts - num_experts / ep; default 1,2 where they fit)")
    p.set_defaults(func=run_plan, takes_overrides=True)


def _numbers(text: str, flag: str, kind):
    """``text``'s comma-separated values: floats > 0 (``kind`` float) or integers >= 1 (``kind`` int)."""
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        rule = "integers >= 1" if kind is int else "numbers > 0"
        raise ValueError(f"{flag} ({text!r}) must be a comma-separated list of {rule}")
    return values


def run_plan(args: argparse.Namespace, overrides: list[str] | tuple[str, ...] = ()) -> int:
    from moetrain.config.loader import load_config
    from moetrain.plan.plan_table import format_plan
    from moetrain.plan.planner import make_plan

    cfg = load_config(args.config, list(overrides))
    if args.rank is not None and not args.dry_run:
        raise ValueError(f"--rank ({args.rank}) needs --dry-run")
    if args.skew is not None or args.routing_trace is not None:
        return _run_skew(args, cfg)
    if args.dry_run:
        return _run_dry_run(args, cfg)
    device_memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    plan = make_plan(cfg, nproc=args.nproc, nodes=args.nodes, device_memory=device_memory,
                     profile=_profile(args))
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(format_plan(plan, top=None if args.all else 20))
    return 0


def _profile(args):
    """The device profile of ``--device-profile`` / ``--calibrate``, or None."""
    from moetrain.plan.step_time import load_profile

    path = args.device_profile
    if args.calibrate is not None:
        from moetrain.plan.calibrate import main as calibrate

        calibrate(["--out", args.calibrate, "--config", args.config or "tiny", "--procs",
                   str(args.nproc // args.nodes)])
        path = args.calibrate
    return None if path is None else load_profile(path, procs_per_node=args.nproc // args.nodes)


def _run_dry_run(args, cfg) -> int:
    from moetrain.plan.dry_run import dry_run_isolated, format_dry_run

    result = dry_run_isolated(cfg, nproc=args.nproc, rank=args.rank)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(format_dry_run(result, name=args.config))
    return 0 if result.matches else 1


def _run_skew(args, cfg) -> int:
    from moetrain.plan.skew import format_skew_plan, make_skew_plan
    from moetrain.plan.skew_check import confirm_buffers, format_buffer_checks

    device_memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    plan = make_skew_plan(cfg, nproc=args.nproc, nodes=args.nodes, skew=args.skew, routing_trace=args.routing_trace,
                          device_memory=device_memory, profile=_profile(args),
                          capacity_factors=_numbers(args.capacity_factors, "--capacity-factors", float),
                          spare_slots=None if args.spare_slots is None
                          else _numbers(args.spare_slots, "--spare-slots", int))
    checks = confirm_buffers(cfg, plan) if args.dry_run else []
    if args.json:
        json.dump({**plan.to_dict(), "buffer_checks": [{**c.__dict__, "confirmed": c.confirmed} for c in checks]},
                  sys.stdout, indent=1)
        print()
    else:
        print(format_skew_plan(plan))
        if checks:
            print(format_buffer_checks(checks))
    return 0 if all(c.confirmed for c in checks) else 1
