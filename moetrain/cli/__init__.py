"""The ``moetrain`` command line: one module per subcommand, each adding its parsers with
``set_defaults(func=...)``; ``main`` parses and calls that function. The commands parse and
print; the work is done by the layers below (train, interop, plan).

    moetrain train --config tiny --nproc 2 --train.steps=100   (train.py: train, demo, config show)
    moetrain plan --config X --nproc N [--nodes M] [--device-memory 80GiB] [--json]       (plan.py)
    moetrain data list | moetrain data fetch shakespeare                                  (data.py)
    moetrain export RUN_DIR --to DIR [--max-shard-size 5GB]       (convert.py: export, convert, upcycle)
    moetrain experts grow RUN --num-experts 2E --to DIR                                   (experts.py)
    moetrain generate RUN --prompt TEXT | moetrain eval RUN_DIR [--nproc N]               (generate.py)
    moetrain compare RUN_A RUN_B [...] [--out DIR]                                        (compare.py)
    moetrain report RUN_DIR                                                               (report.py)
    moetrain verify --config X [--layouts "ep=2; pp=2,ep=2" | auto] [--steps 3] [--json F]  (verify.py)
    moetrain launch slurm|k8s --config X --nodes N --gpus-per-node G [--out FILE]; launch store (cluster.py)

Each module's docstring lists its commands' options. ``python -m moetrain.cli`` runs the same
``main`` (torchrun: ``torchrun ... -m moetrain.cli train --config X``).
"""

from __future__ import annotations

import argparse
import sys

from moetrain.cli import cluster, compare, convert, data, experts, generate, plan, report, train, verify

SUBCOMMANDS = (train, plan, verify, data, convert, experts, generate, compare, report, cluster)
"""The modules whose ``add_parsers(sub)`` add the subcommands, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moetrain", description="Train Mixture-of-Experts models.",
                                epilog="Any --section.field=value (or --section.field value) argument overrides "
                                       "the config, a --deepspeed JSON's values included.")
    # Only the job commands (train, demo, config, plan, launch, verify) take --section.field=value overrides.
    p.set_defaults(takes_overrides=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    for module in SUBCOMMANDS:
        module.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    bad = _not_overrides(overrides) if args.takes_overrides else overrides
    if bad:
        parser.error(f"unrecognised arguments: {' '.join(bad)}")
    args.argv = argv  # what a command that starts local processes hands them
    try:
        return args.func(args, overrides)
    except ValueError as e:
        # Bad input: one clear line, no traceback (the config is validated before any work).
        print(f"moetrain: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from moetrain.data.cache import CorpusUnavailableError

        if not isinstance(e, CorpusUnavailableError):
            raise
        print(f"moetrain: error: {e}", file=sys.stderr)
        return 2


def _not_overrides(extra: list[str]) -> list[str]:
    """The arguments argparse left over that are not ``--section.field=value`` overrides. An override
    written ``--section.field value`` takes the next argument as its value, the way
    ``moetrain.config.parse_overrides`` reads it (a value may start with one '-': ``--parallel.dp -1``)."""
    bad, i = [], 0
    while i < len(extra):
        key, sep, _ = extra[i].partition("=")
        if "." not in key:
            bad.append(extra[i])
        elif not sep and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            i += 1  # the value of the override before it
        i += 1
    return bad
