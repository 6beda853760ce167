"""``moetrain compare``: runs side by side (``moetrain.train.compare``).

    moetrain compare RUN_A RUN_B [...] [--out DIR]    (plots per quantity, final figures, config differences)
"""

from __future__ import annotations

import argparse


def add_parsers(sub) -> None:
    cmp = sub.add_parser("compare", help="compare runs: plots per quantity, final figures, config differences")
    cmp.add_argument("runs", nargs="+", metavar="RUN", help="run folders (two or more)")
    cmp.add_argument("--out", default="compare", help="output folder (default ./compare)")
    cmp.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.train.compare import compare_runs

    for p in compare_runs(args.runs, args.out):
        print(p)
    return 0
