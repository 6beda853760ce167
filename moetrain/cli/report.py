"""``moetrain report``: PNG plots of a run (``moetrain.train.report``).

    moetrain report RUN_DIR [--out DIR]
"""

from __future__ import annotations

import argparse


def add_parsers(sub) -> None:
    rep = sub.add_parser("report", help="write PNG plots of a run")
    rep.add_argument("run_dir")
    rep.add_argument("--out", default=None, help="folder of the PNGs (default RUN_DIR/report)")
    rep.set_defaults(func=run_report)


def run_report(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.train.report import write_report

    for p in write_report(args.run_dir, args.out):
        print(p)
    return 0
