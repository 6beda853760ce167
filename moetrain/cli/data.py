"""``moetrain data``: the corpora of the registry.

    moetrain data list
    moetrain data fetch shakespeare [--cache-dir DIR] [--force]
    moetrain data prepare INPUT... --out DIR [--tokenizer bpe|bytes|PATH/tokenizer.json] [--field text]
                          [--workers N] [--skip-bad] [--format moetrain|megatron] [--shard-docs N]
                          [--vocab-size V]

``prepare`` tokenises jsonl (.gz, .zst), parquet and saved ``datasets`` folders into token shards
that ``data.corpus=path data.path=DIR`` trains on (moetrain.data.prepare_corpus); rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import os


def add_parsers(sub) -> None:
    data = sub.add_parser("data", help="corpora")
    data_sub = data.add_subparsers(dest="data_cmd", required=True)
    data_sub.add_parser("list").set_defaults(func=run_list)
    fetch = data_sub.add_parser("fetch")
    fetch.add_argument("name")
    fetch.add_argument("--cache-dir", default=None)
    fetch.add_argument("--force", action="store_true")
    fetch.set_defaults(func=run_fetch)
    prepare = data_sub.add_parser("prepare", help="tokenise jsonl/parquet/arrow corpora into token shards")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT",
                         help=".jsonl, .jsonl.gz, .jsonl.zst, .parquet, a save_to_disk folder, or a folder of them")
    prepare.add_argument("--out", required=True, help="output folder (rerun with the same one to resume)")
    prepare.add_argument("--tokenizer", default="bpe", help="bpe (trained on the inputs), bytes, or a tokenizer.json")
    prepare.add_argument("--field", default="text", help="the record field (column) holding the text")
    prepare.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                         help="tokenising processes (default: the cores available)")
    prepare.add_argument("--skip-bad", action="store_true", help="skip and count bad records instead of failing")
    prepare.add_argument("--format", default="moetrain", choices=["moetrain", "megatron"],
                         help="megatron: Megatron-LM's .bin + .idx")
    prepare.add_argument("--shard-docs", type=int, default=1 << 17, help="records of one input per shard")
    prepare.add_argument("--vocab-size", type=int, default=4096, help="size of the BPE trained by --tokenizer bpe")
    prepare.set_defaults(func=run_prepare)


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


def run_prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.data.prepare_corpus import PrepareOptions, prepare_corpus

    options = PrepareOptions(out_dir=args.out, tokenizer=args.tokenizer, text_field=args.field,
                             num_workers=args.workers, skip_bad=args.skip_bad, output_format=args.format,
                             shard_docs=args.shard_docs, vocab_size=args.vocab_size)
    manifest = prepare_corpus(args.inputs, options)
    print(f"{args.out}: {manifest['num_shards']} shards, {manifest['num_documents']} documents, "
          f"{manifest['num_tokens']} tokens ({manifest['dtype']}), {manifest['num_bad']} bad records")
    for message in manifest["bad"][:10]:
        print(f"  skipped: {message}")
    return 0
