"""``moetrain verify``: prove on CPU-sized runs that each parallel layout trains the same model as one
process (``moetrain.verify``; docs/verify.md).

    moetrain verify --config JOB [--layouts "ep=2,dp=2; pp=2,ep=2; zero=3,ep=2" | auto] [--steps 3]
                    [--shrink auto|none] [--json FILE] [--work DIR] [--section.field=value ...]

Prints what the shrink changed, the settings excluded as random per rank, then a table (quantity |
max abs diff | max rel diff | tolerance | PASS/FAIL). Exits 1 when a quantity fails; the last line
names the first. Without ``--work`` the runs (checkpoints of every step, about 1 GB for a shrunk
job) go to a temporary folder, removed when the verification passes and kept, and named, when not.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path


def add_parsers(sub) -> None:
    sp = sub.add_parser("verify", help="check that the job's parallel layouts train the same model as one process")
    sp.add_argument("--config", required=True, help="YAML config or a shipped config's name")
    sp.add_argument("--deepspeed", default=None,
                    help="import a DeepSpeed JSON config (explicit --section.field=value "
                         "overrides win over its values)")
    sp.add_argument("--layouts", default="auto",
                    help='layouts to verify, ";"-separated, e.g. "ep=2,dp=2; pp=2,ep=2; zero=3,ep=2" '
                         "(keys dp, ep, tp, pp, etp, zero), or auto: the two layouts moetrain plan ranks best "
                         "for the job at --nproc processes, folded to at most 4 processes (one with ep > 1 "
                         "for an MoE job)")
    sp.add_argument("--nproc", type=int, default=None,
                    help="the job's real world size, for --layouts auto (default: the fewest processes its "
                         "parallel degrees need, at least 2)")
    sp.add_argument("--steps", type=int, default=3, help="training steps compared per layout (default 3)")
    sp.add_argument("--shrink", choices=("auto", "none"), default="auto",
                    help="auto: make the job CPU-sized, keeping everything that changes the math (default)")
    sp.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    sp.add_argument("--work", default=None, metavar="DIR",
                    help="folder for the runs, kept (default: a temporary one, removed when every check passes)")
    sp.set_defaults(func=run_verify, takes_overrides=True)


def run_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from moetrain.config.loader import load_config
    from moetrain.verify.driver import plan_verification, run_verification
    from moetrain.verify.layouts import parse_layouts
    from moetrain.verify.report import last_line, table, write_json
    from moetrain.verify.runs import RunFailed
    from moetrain.verify.shrink import RANDOM_PER_RANK

    # A DeepSpeed config's batch sizes are per process: read at one, as the shrunk job's reference runs.
    cfg = load_config(args.config, overrides, deepspeed=args.deepspeed, world_size=1 if args.deepspeed else None)
    layouts = None if args.layouts.strip() == "auto" else parse_layouts(args.layouts)
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc ({args.nproc}) must be >= 1")
    plan = plan_verification(cfg, layouts=layouts, steps=args.steps, shrink=args.shrink == "auto",
                             cpu=not torch.cuda.is_available(), nproc=args.nproc)
    print(f"layouts: {', '.join(f'{lay.name} ({lay.world} processes)' for lay in plan.layouts)}")
    print("job changes for verification:")
    for change in plan.changes:
        print(f"  {change.line()}")
    print("excluded (random per rank by design): " + "; ".join(f"{k}: {v}" for k, v in RANDOM_PER_RANK.items()))
    own_work = args.work is None
    work = Path(tempfile.mkdtemp(prefix="moetrain-verify-")) if own_work else Path(args.work)
    try:
        result = run_verification(plan, work=work)
    except RunFailed as e:  # the world-1 reference itself did not train: nothing to compare with
        print(f"moetrain: error: {e}", file=sys.stderr)
        print(f"runs and logs kept in {work}", file=sys.stderr)
        return 2
    print()
    print(table(result))
    if args.json:
        write_json(args.json, result, changes=plan.changes, layouts=[lay.name for lay in plan.layouts],
                   excluded=RANDOM_PER_RANK, steps=plan.steps)
    if own_work and result.first_failure is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"runs and logs kept in {work}")
    print(last_line(result))
    return 0 if result.first_failure is None else 1

