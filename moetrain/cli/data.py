"""``moetrain data``: the corpora of the registry.

    moetrain data list
    moetrain data fetch shakespeare [--cache-dir DIR] [--force]
"""

from __future__ import annotations

import argparse


def add_parsers(sub) -> None:
    data = sub.add_parser("data", help="corpora")
    data_sub = data.add_subparsers(dest="data_cmd", required=True)
    data_sub.add_parser("list").set_defaults(func=run_list)
    fetch = data_sub.add_parser("fetch")
    fetch.add_argument("name")
    fetch.add_argument("--cache-dir", default=None)
    fetch.add_argument("--force", action="store_true")
    fetch.set_defaults(func=run_fetch)


def run_list(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.data import is_cached, list_corpora

    for c in list_corpora():
        print(f"{c.name:14s} {'cached' if is_cached(c.name) else 'not cached':10s} ~{c.approx_mb} MB  "
              f"{c.licence}  {c.description}")
    return 0


def run_fetch(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.data import fetch_corpus

    path = fetch_corpus(args.name, cache_dir=args.cache_dir, force=args.force)
    print(f"{args.name}: {path}")
    return 0
