"""``moetrain train``, ``moetrain demo`` and ``moetrain config show``: a job from a config (a
shipped name or a YAML path), ``--section.field=value`` overrides and an optional DeepSpeed JSON.

    moetrain train --config tiny --nproc 2 --train.steps=100
    moetrain train --init-from-hf HF_DIR --nproc 2 ...         (start from a Hugging Face MoE checkpoint)
    torchrun --nnodes 2 --nproc-per-node 8 ... -m moetrain.cli train --config X     (multi-node)
    moetrain demo
    moetrain config show --config X [--nproc N] [--deepspeed DS.json] [--section.field=value ...]

With ``--nproc N`` the job is checked here, once, then started in N processes; a bad config
never reaches the ranks.
"""

from __future__ import annotations

import argparse

from moetrain.cli.launch import (
    add_job_args,
    check_model,
    launch,
    load_job,
    record_exit_code,
    strip_option,
    under_launcher,
    world_size,
)

DEMO_CONFIG = "tiny"
"""The shipped config ``moetrain demo`` trains (moetrain/configs/tiny.yaml)."""


def add_parsers(sub) -> None:
    train = sub.add_parser("train", help="train a model")
    _add_train_args(train)
    train.add_argument("--init-from-hf", default=None, metavar="HF_DIR",
                       help="start from a Hugging Face checkpoint (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3): "
                            "its model/moe config, weights and tokenizer.json")
    train.set_defaults(func=run_train, takes_overrides=True)
    demo = sub.add_parser("demo", help="the default job: tiny MoE LM on Shakespeare, EP=2 on 2 processes")
    _add_train_args(demo, default_config=DEMO_CONFIG)
    demo.set_defaults(func=run_demo, takes_overrides=True, nproc=2, sample_tokens=120, init_from_hf=None)

    cfg = sub.add_parser("config", help="show the resolved config")
    cfg_sub = cfg.add_subparsers(dest="config_cmd", required=True)
    show = cfg_sub.add_parser("show")
    show.add_argument("--config", default=None, help="YAML config or a shipped config's name")
    show.add_argument("--deepspeed", default=None,
                      help="import a DeepSpeed JSON config (explicit --section.field=value "
                           "overrides win over its values)")
    show.add_argument("--nproc", type=int, default=None,
                      help="world size: checks the parallel layout and sizes --deepspeed batches")
    cfg.set_defaults(func=run_config_show, takes_overrides=True)


def _add_train_args(sp: argparse.ArgumentParser, *, default_config: str | None = None) -> None:
    add_job_args(sp, default_config=default_config)
    sp.add_argument("--prompt", default="ROMEO:", help="prompt of the sample printed at the end")
    sp.add_argument("--sample-tokens", type=int, default=0, help="tokens to sample at the end (0 = none)")


def run_demo(args: argparse.Namespace, overrides: list[str]) -> int:
    if not any(o.lstrip("-").startswith("log.run_dir") for o in overrides):
        # Every `moetrain demo` is a fresh run (a fixed folder would resume the finished one and
        # train nothing). Chosen here, before the ranks start, so that they all agree on it.
        import time

        run_dir = f"--log.run_dir=runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
        overrides, args.argv = [*overrides, run_dir], [*args.argv, run_dir]
    return run_train(args, overrides)


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    argv = args.argv
    if args.init_from_hf is not None:
        # Converted once here; the launched processes get the resulting overrides explicitly.
        from moetrain.interop.hf.train_from import init_from_hf_overrides

        extra = init_from_hf_overrides(args.init_from_hf, config=args.config, overrides=overrides)
        overrides, argv = [*extra, *overrides], [*strip_option(argv, "--init-from-hf"), *extra]
    world = world_size(args, default=1)
    cfg = load_job(args, overrides, world=world, sample_tokens=args.sample_tokens)
    if args.nproc and args.nproc > 1 and not under_launcher():
        check_model(cfg)  # the model's own rules, once here rather than once per rank
        from moetrain.train.checkpoint.launch_check import check_job_checkpoints

        check_job_checkpoints(cfg)  # the checkpoints it names too: one line, not one error per rank
        return launch(args.nproc, argv)
    from moetrain.distributed import runtime

    code, num_ranks = _train_and_report(args, cfg)
    record_exit_code(code)
    if num_ranks > 1:
        # Every file of the run is closed and the process group is gone: skip the interpreter's
        # finalisation, where a late gloo worker thread would abort a rank that succeeded.
        runtime.exit_process(code)
    return code


def _train_and_report(args: argparse.Namespace, cfg) -> tuple[int, int]:
    """Train this rank's part of ``cfg``; rank 0 then writes the report and prints the summary.
    Returns the exit code (143 after a SIGTERM, whose checkpoint is saved) and the world size."""
    from moetrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        final = trainer.fit()
        if not trainer.interrupted:
            sample = _sample(trainer, args.prompt, args.sample_tokens) if args.sample_tokens else None
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
        # Imported here: matplotlib costs every rank a third of a second at start-up otherwise.
        from moetrain.train.report import write_report

        # The report reads metrics.jsonl, which log.jsonl false does not write.
        draw = cfg.log.report and cfg.log.jsonl
        pngs = write_report(trainer.run_dir) if draw else []
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
        drawn = ", ".join(p.name for p in pngs) if draw else (
            "not drawn, " + ("log.jsonl" if cfg.log.report else "log.report") + " is false")
        print(f"run directory: {trainer.run_dir}  (config.yaml, metrics.jsonl, tensorboard/, report/: {drawn})")
    return 0, trainer.world_size


def run_config_show(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.config.loader import format_config

    print(format_config(load_job(args, overrides, world=world_size(args, default=None))))
    return 0


def _sample(trainer, prompt: str, max_new_tokens: int) -> str:
    """``prompt`` continued by the trained model, with its weight average if it keeps one (collective:
    every rank runs the same computation)."""
    from moetrain.train.generation import sample_text

    data = trainer.data
    if data.tokenizer is None:
        raise ValueError("data.path holds pre-tokenised .bin files: no tokenizer to decode samples")
    assert trainer.pipeline is None, "sampling needs the whole model (the command line refuses it under pp)"
    trainer.parallel_model.eval()
    with trainer.averaged_weights():
        return sample_text(trainer.model, data.tokenizer, prompt, context=trainer.cfg.data.seq_len,
                           device=trainer.device, fallback_id=data.eos_id or 0, max_new_tokens=max_new_tokens)
