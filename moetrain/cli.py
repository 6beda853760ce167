"""`moetrain` command line: train, demo, config, data, report.

    moetrain train --config tiny --nproc 2 --train.steps=100   (a shipped config's name, or a YAML path)
    moetrain train --init-from-hf HF_DIR --nproc 2 ...         (start from a Hugging Face MoE checkpoint)
    torchrun --nnodes 2 --nproc-per-node 8 ... -m moetrain.cli train --config X     (multi-node)
    moetrain demo
    moetrain config show --config X [--nproc N] [--deepspeed DS.json] [--section.field=value ...]
    moetrain data list | moetrain data fetch shakespeare
    moetrain report RUN_DIR
    moetrain eval RUN_DIR [--split test|val] [--checkpoint PATH] [--nproc N]   (metrics of a saved run)
    moetrain compare RUN_A RUN_B [...] [--out DIR]    (side-by-side plots, final figures, config differences)
    moetrain plan --config X --nproc N [--nodes M] [--device-memory 80GiB] [--json]
    moetrain export RUN_DIR --to DIR                 (consolidated safetensors + config.yaml)
    moetrain convert RUN_DIR --to-hf DIR [--family F] [--fused] [--dtype bf16] [--max-shard-size 5GB]
                                                     (Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V3)
    moetrain convert --from-hf DIR --to DIR          (a Hugging Face model as a moetrain export)
    moetrain experts grow RUN --num-experts 2E --to DIR [--top-k K] [--noise STD] [--seed S]
                                                     (copies of a trained MoE's experts, as an export)
    moetrain upcycle --from-hf DENSE_DIR --num-experts E --top-k K --to DIR [--granularity G] [--noise STD]
                                                     (a dense Llama / Qwen3 as an MoE export, experts = its FFN)
    moetrain generate RUN --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --seed S
                      --checkpoint PATH]             (continue a prompt, key/value cache, prints tokens/s)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

DEMO_CONFIG = "tiny"
"""The shipped config ``moetrain demo`` trains (moetrain/configs/tiny.yaml)."""


def _under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _launch(nproc: int, argv: list[str]) -> int:
    """Re-run this command in ``nproc`` local processes through torch.distributed.run (what
    torchrun is), single node, with its own rendezvous on a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "moetrain.cli", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def _world_size(args) -> int | None:
    """Processes of the job when the command knows them: torchrun's WORLD_SIZE, else --nproc;
    ``train`` without either runs one process; ``config show`` without either does not know."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if getattr(args, "nproc", None):
        return args.nproc
    return 1 if args.cmd in ("train", "demo") else None


def _load(args, overrides: list[str]):
    """The job config of ``args``, checked as far as the command knows the job: the corpus name
    always, the parallel layout (ParallelDims's rules) when the world size is known."""
    from moetrain.config.loader import load_config
    from moetrain.data.registry import check_corpus

    world = _world_size(args)
    deepspeed = getattr(args, "deepspeed", None)
    # A DeepSpeed config's batch sizes are per process: without a world size, one process.
    cfg = load_config(args.config, overrides, deepspeed=deepspeed, world_size=world or 1)
    check_corpus(cfg.data.corpus)
    if getattr(args, "sample_tokens", 0) and cfg.parallel.pp > 1:
        raise ValueError(f"--sample-tokens ({args.sample_tokens}) needs the whole model in each process, and "
                         f"parallel.pp ({cfg.parallel.pp}) splits it: sample after training with `moetrain generate`")
    ep = cfg.parallel.ep
    from moetrain.distributed.parallel_dims import ParallelDims

    num_experts = cfg.moe.num_experts if cfg.model.is_moe else None
    if world is None:
        if deepspeed is not None and ep > 1:
            raise ValueError(f"moe.ep_size ({ep}) of {deepspeed} needs a world of at least {ep} processes: "
                             "pass --nproc N, the number of processes of the job")
        # The rules that hold at any world size, checked at the smallest world the layout allows.
        par = cfg.parallel
        ParallelDims(world_size=ep * par.etp * par.tp * par.pp, ep=ep, tp=par.tp, pp=par.pp, etp=par.etp,
                     num_experts=num_experts, ep_hierarchical=par.ep_hierarchical)
        return cfg
    try:
        dims = ParallelDims.from_config(cfg.parallel, world_size=world, num_experts=num_experts)
        cfg.train.grad_accum_steps(dims.dp)
    except ValueError as e:
        told = "WORLD_SIZE" in os.environ or getattr(args, "nproc", None)
        raise ValueError(str(e) if told else f"{e} (this runs 1 process: pass --nproc N to launch N)") from e
    return cfg


def _strip_init_from_hf(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip or a.startswith("--init-from-hf="):
            skip = False
            continue
        skip = a == "--init-from-hf"
        if not skip:
            out.append(a)
    return out


def cmd_train(args, overrides: list[str], argv: list[str], *, demo: bool = False) -> int:
    if args.init_from_hf is not None:
        # Converted once here; the launched processes get the resulting overrides explicitly.
        from moetrain.interop.hf.train_from import init_from_hf_overrides

        extra = init_from_hf_overrides(args.init_from_hf, config=args.config, overrides=overrides)
        overrides, argv = [*extra, *overrides], [*_strip_init_from_hf(argv), *extra]
    if demo and not any(o.lstrip("-").startswith("log.run_dir") for o in overrides):
        # Every `moetrain demo` is a fresh run (a fixed folder would resume the finished one and
        # train nothing). Chosen here, before the ranks start, so that they all agree on it.
        import time

        run_dir = f"--log.run_dir=runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
        overrides, argv = [*overrides, run_dir], [*argv, run_dir]
    if args.nproc and args.nproc > 1 and not _under_launcher():
        _load(args, overrides)  # validate before starting processes: errors show once, early
        return _launch(args.nproc, _strip_nproc(argv))
    from moetrain.distributed import runtime

    code, world_size = _train_and_report(args, _load(args, overrides))
    if world_size > 1:
        # Every file of the run is closed and the process group is gone: skip the interpreter's
        # finalisation, where a late gloo worker thread would abort a rank that succeeded.
        runtime.exit_process(code)
    return code


def _train_and_report(args, cfg) -> tuple[int, int]:
    """Train this rank's part of ``cfg``; rank 0 then writes the report and prints the summary.
    Returns the exit code (143 after a SIGTERM, whose checkpoint is saved) and the world size."""
    from moetrain.train.report import write_report
    from moetrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        final = trainer.fit()
        if not trainer.interrupted:
            sample = trainer.generate(args.prompt, max_new_tokens=args.sample_tokens) if args.sample_tokens else None
        # A last collective that every rank waits in: the run's final collectives (the
        # checkpoint's outcome broadcast) leave gloo worker threads releasing Python-owned tensors
        # just after the ranks return from them, and this hands them the GIL while every rank is
        # still running.
        trainer.barrier()
    finally:
        trainer.close()
    if trainer.interrupted:  # 128 + 15 tells the launcher the run did not finish
        return 143, trainer.world_size
    if trainer.is_main:
        pngs = write_report(trainer.run_dir)
        print()
        if "test_accuracy" in final:  # a classifier's last eval covers the test split
            print(f"final test accuracy {final['test_accuracy']:.4f} (macro-F1 {final['test_macro_f1']:.4f}; val "
                  f"accuracy {final['val_accuracy']:.4f}) after {trainer.step} steps; "
                  f"{final['samples_per_s']:.0f} samples/s")
        elif "val_loss" in final:
            print(f"final val loss {final['val_loss']:.4f} (perplexity {final['val_ppl']:.1f}) "
                  f"after {trainer.step} steps; {final['tokens_per_s']:.0f} tokens/s")
        if sample is not None:
            print("--- sample ---")
            print(sample)
            print("--------------")
        print(f"run directory: {trainer.run_dir}  (config.yaml, metrics.jsonl, tensorboard/, report/: "
              f"{', '.join(p.name for p in pngs)})")
    return 0, trainer.world_size


def cmd_config(args, overrides: list[str]) -> int:
    from moetrain.config.loader import format_config

    print(format_config(_load(args, overrides)))
    return 0


def cmd_data(args) -> int:
    from moetrain.data import fetch_corpus, is_cached, list_corpora

    if args.data_cmd == "list":
        for c in list_corpora():
            print(f"{c.name:14s} {'cached' if is_cached(c.name) else 'not cached':10s} ~{c.approx_mb} MB  "
                  f"{c.licence}  {c.description}")
        return 0
    path = fetch_corpus(args.name, cache_dir=args.cache_dir, force=args.force)
    print(f"{args.name}: {path}")
    return 0


def cmd_compare(args) -> int:
    from moetrain.train.compare import compare_runs

    for p in compare_runs(args.runs, args.out):
        print(p)
    return 0


def cmd_eval(args, argv: list[str]) -> int:
    """Evaluate a saved run's checkpoint at this job's process count; rank 0 prints the metrics and
    writes them to RUN_DIR/eval-<split>-step<N>.json."""
    if args.nproc and args.nproc > 1 and not _under_launcher():
        return _launch(args.nproc, _strip_nproc(argv))
    from moetrain.distributed import runtime
    from moetrain.train.evaluate import evaluate_run

    try:
        result = evaluate_run(args.run_dir, split=args.split, checkpoint=args.checkpoint)
    finally:
        runtime.shutdown()
    if result is not None:
        split, where = result["split"], f"step {result['step']}, {result['world_size']} process(es)"
        if result["weights"] == "average":
            where += ", averaged weights"
        if f"{split}_accuracy" in result:
            print(f"{split} accuracy {result[f'{split}_accuracy']:.4f}  macro-F1 {result[f'{split}_macro_f1']:.4f}  "
                  f"loss {result[f'{split}_loss']:.4f}  ({result[f'{split}_examples']} examples; {where})")
            names = _class_names(args.run_dir, len(result[f"{split}_per_class_f1"]))
            for name, f1 in zip(names, result[f"{split}_per_class_f1"]):
                print(f"  F1 {'-' if f1 is None else f'{f1:.4f}':>6s}  {name}")
        else:
            print(f"val loss {result['val_loss']:.4f}  perplexity {result['val_ppl']:.2f}  ({where})")
        print(f"written to {args.run_dir}/eval-{split}-step{result['step']}.json")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        runtime.exit_process(0)  # as train: skip a finalisation where late gloo threads abort a rank
    return 0


def _class_names(run_dir: str, num_classes: int) -> list[str]:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(run_dir) / "classes.json").read_text(encoding="utf-8"))["classes"]
    except (OSError, ValueError, KeyError):
        return [f"class {i}" for i in range(num_classes)]


def cmd_report(args) -> int:
    from moetrain.train.report import write_report

    for p in write_report(args.run_dir, args.out):
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from moetrain.config.loader import shipped_config_names

    p = argparse.ArgumentParser(prog="moetrain", description="Train Mixture-of-Experts models.",
                                epilog="Any --section.field=value argument overrides the config.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_train_args(sp, *, default_config=None):
        sp.add_argument("--config", default=default_config,
                        help="YAML config (a run's config.yaml reproduces it) or a shipped config's name: "
                             + ", ".join(shipped_config_names()))
        sp.add_argument("--deepspeed", default=None, help="import a DeepSpeed JSON config")
        sp.add_argument("--nproc", type=int, default=None,
                        help="launch N local processes (torch.distributed.run); not needed under torchrun")
        sp.add_argument("--prompt", default="ROMEO:", help="prompt of the sample printed at the end")
        sp.add_argument("--sample-tokens", type=int, default=0, help="tokens to sample at the end (0 = none)")

    train = sub.add_parser("train", help="train a model")
    add_train_args(train)
    train.add_argument("--init-from-hf", default=None, metavar="HF_DIR",
                       help="start from a Hugging Face checkpoint (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3): "
                            "its model/moe config, weights and tokenizer.json")
    demo = sub.add_parser("demo", help="the default job: tiny MoE LM on Shakespeare, EP=2 on 2 processes")
    add_train_args(demo, default_config=DEMO_CONFIG)
    demo.set_defaults(nproc=2, sample_tokens=120, init_from_hf=None)

    cfg = sub.add_parser("config", help="show the resolved config")
    cfg_sub = cfg.add_subparsers(dest="config_cmd", required=True)
    show = cfg_sub.add_parser("show")
    show.add_argument("--config", default=None, help="YAML config or a shipped config's name")
    show.add_argument("--deepspeed", default=None, help="import a DeepSpeed JSON config")
    show.add_argument("--nproc", type=int, default=None,
                      help="world size: checks the parallel layout and sizes --deepspeed batches")

    data = sub.add_parser("data", help="corpora")
    data_sub = data.add_subparsers(dest="data_cmd", required=True)
    data_sub.add_parser("list")
    fetch = data_sub.add_parser("fetch")
    fetch.add_argument("name")
    fetch.add_argument("--cache-dir", default=None)
    fetch.add_argument("--force", action="store_true")

    cmp = sub.add_parser("compare", help="compare runs: plots per quantity, final figures, config differences")
    cmp.add_argument("runs", nargs="+", metavar="RUN", help="run folders (two or more)")
    cmp.add_argument("--out", default="compare", help="output folder (default ./compare)")

    ev = sub.add_parser("eval", help="metrics of a saved run (classifier: accuracy, macro-F1, per-class F1; "
                                     "LM: loss, perplexity) at any process count")
    ev.add_argument("run_dir", help="run folder (its config.yaml and checkpoints)")
    ev.add_argument("--split", choices=("test", "val"), default=None,
                    help="classifier: test (default) or val; LM: val (the whole validation stream)")
    ev.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the run's newest)")
    ev.add_argument("--nproc", type=int, default=None, help="evaluate in N local processes")

    rep = sub.add_parser("report", help="write PNG plots of a run")
    rep.add_argument("run_dir")
    rep.add_argument("--out", default=None, help="folder of the PNGs (default RUN_DIR/report)")

    from moetrain.interop.convert_cli import add_convert_parsers

    add_convert_parsers(sub)
    from moetrain.interop.experts_cli import add_experts_parser

    add_experts_parser(sub)
    from moetrain.interop.generate_cli import add_generate_parser

    add_generate_parser(sub)
    from moetrain.plan.cli import add_plan_parser

    add_plan_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest]
    bad = [a for a in overrides if "." not in a.split("=")[0]]
    if bad and args.cmd in ("train", "demo", "config"):
        parser.error(f"unrecognised arguments: {' '.join(bad)}")
    try:
        if args.cmd in ("train", "demo"):
            return cmd_train(args, overrides, argv, demo=args.cmd == "demo")
        if args.cmd == "config":
            return cmd_config(args, overrides)
        if args.cmd == "plan":
            from moetrain.plan.cli import run_plan

            return run_plan(args, overrides)
        if overrides:
            parser.error(f"unrecognised arguments: {' '.join(overrides)}")
        if args.cmd == "data":
            return cmd_data(args)
        if args.cmd == "compare":
            return cmd_compare(args)
        if args.cmd == "eval":
            return cmd_eval(args, argv)
        if args.cmd == "report":
            return cmd_report(args)
        if args.cmd in ("export", "convert", "upcycle"):
            from moetrain.interop.convert_cli import run_convert_command

            return run_convert_command(args, parser)
        if args.cmd == "experts":
            from moetrain.interop.experts_cli import run_experts

            return run_experts(args)
        if args.cmd == "generate":
            from moetrain.interop.generate_cli import run_generate

            return run_generate(args)
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
    return 1


if __name__ == "__main__":
    sys.exit(main())
