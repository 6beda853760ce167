"""``moetrain generate`` and ``moetrain eval``: a trained model at work.

    moetrain generate RUN --prompt "ROMEO:" [--max-new-tokens 100] [--temperature 0.8] [--top-k 50]
                      [--top-p 1.0] [--seed 0] [--checkpoint PATH] [--tokenizer tokenizer.json]
                      [--device auto|cpu|cuda] [--dtype fp32|bf16] [--no-cache] [--ignore-eos] [--speculative]
    moetrain eval RUN_DIR [--split test|val] [--checkpoint PATH] [--nproc N]

``generate`` continues a prompt in one process, one token per forward with a key/value cache
(``moetrain.interop.generation`` loads the model and its tokenizer). RUN is a run folder (its
newest checkpoint), a checkpoint or a moetrain export, whatever parallel layout wrote it; the
tokenizer is the run's (the tokenizer.json saved in its run folder or export, or copied by
``convert --from-hf``: no corpus needed), or ``--tokenizer`` (a ``tokenizer.json``, or "bytes"),
which a Hugging Face model imported without a tokenizer.json needs.
It prints the prompt and its continuation, then one line of figures: new tokens, seconds, tokens/s
overall and of the decoding steps after the first. ``--speculative`` decodes greedily with the
model's multi-token modules (``model.mtp_depth``) drafting the next tokens and one forward
verifying them (``generate_speculative``): the same tokens as greedy decoding, and the drafts'
acceptance rate on the figures line.

``eval`` measures a saved run's checkpoint at any process count (``moetrain.train.evaluate``):
classifier accuracy, macro-F1 and per-class F1, or LM loss and perplexity.
"""

from __future__ import annotations

import argparse
import os

DTYPES = ("fp32", "bf16")


def add_parsers(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model (key/value cache, one process)")
    p.add_argument("source", metavar="RUN", help="run folder (its newest checkpoint), checkpoint or moetrain export")
    p.add_argument("--prompt", required=True, help="text to continue (empty: start after an end-of-text token)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=None,
                   help="softmax temperature; 0 = greedy (default 0.8; 0 with --speculative)")
    p.add_argument("--top-k", type=int, default=50, help="sample from the K most likely tokens; 0 = all (default 50)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="then from the smallest set of them holding this probability; 1 = all (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--checkpoint", default=None, help="this checkpoint folder instead of RUN's newest")
    p.add_argument("--tokenizer", default=None,
                   help='a tokenizer.json, or "bytes" (default: the tokenizer.json saved with the run or '
                        'export, else the run\'s data.tokenizer)')
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when available, else CPU (default auto)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="weights and cache dtype (default fp32)")
    p.add_argument("--no-cache", action="store_true",
                   help="a full forward over the whole sequence per token (the reference the cache reproduces, "
                        "but for dynamic rope scaling past its original length)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--speculative", action="store_true",
                   help="greedy, drafted by the model's multi-token modules (model.mtp_depth > 0) and verified "
                        "by one forward per step: the same tokens, fewer forwards")
    p.set_defaults(func=run_generate)

    ev = sub.add_parser("eval", help="metrics of a saved run (classifier: accuracy, macro-F1, per-class F1; "
                                     "LM: loss, perplexity) at any process count")
    ev.add_argument("run_dir", help="run folder (its config.yaml and checkpoints)")
    ev.add_argument("--split", choices=("test", "val"), default=None,
                    help="classifier: test (default) or val; LM: val (the whole validation stream)")
    ev.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the run's newest)")
    ev.add_argument("--nproc", type=int, default=None, help="evaluate in N local processes")
    ev.set_defaults(func=run_eval)


def run_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from moetrain.config.train import resolve_device
    from moetrain.interop.generation import (
        apply_document_mask,
        load_generation_model,
        load_tokenizer,
        require_vocab,
    )
    from moetrain.train.generation import Generation, generate, generate_speculative

    if args.speculative:
        for flag, value, ok in (("--temperature", args.temperature, args.temperature in (None, 0)),
                                ("--no-cache", args.no_cache, not args.no_cache)):
            if not ok:
                raise ValueError(f"{flag} ({value}) cannot be used with --speculative: it decodes greedily, "
                                 "with a cache, verifying the drafts against the greedy choices")
    temperature = (0.0 if args.speculative else 0.8) if args.temperature is None else args.temperature
    model, config = load_generation_model(args.checkpoint or args.source)
    tokenizer = load_tokenizer(config, args.tokenizer, source=args.source)
    require_vocab(tokenizer, model)
    apply_document_mask(model, config, tokenizer)
    device = resolve_device(args.device)
    model = model.to(device=device, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    ids = tokenizer.encode(args.prompt)
    if not ids:
        if tokenizer.eos_id is None:
            raise ValueError("--prompt ('') must not be empty with a tokenizer that has no end-of-text token")
        ids = [tokenizer.eos_id]  # the token stream puts it before every document but the first
    prompt = torch.tensor([ids], device=device)
    stop_id = None if args.ignore_eos else tokenizer.eos_id
    out: Generation
    if args.speculative:
        out = generate_speculative(model, prompt, max_new_tokens=args.max_new_tokens, stop_id=stop_id)
    else:
        out = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=temperature,
                       top_k=args.top_k or None, top_p=None if args.top_p == 1 else args.top_p, seed=args.seed,
                       use_cache=not args.no_cache, stop_id=stop_id)
    print(tokenizer.decode(out.ids_BS[0].tolist()))
    print(figures_line(out, cache=not args.no_cache, device=device, dtype=args.dtype))
    return 0


def figures_line(out, *, cache: bool, device, dtype: str) -> str:
    """One line of a ``Generation``'s figures: new tokens, seconds, tokens/s."""
    total_s = out.prefill_s + out.decode_s
    decode = f"; decode {out.decode_tokens_per_s:.1f} tokens/s" if out.num_new > 1 else ""
    from moetrain.train.generation import SpeculativeGeneration

    drafts = ""
    if isinstance(out, SpeculativeGeneration):
        drafts = (f"; speculative: {out.num_accepted} of {out.num_drafted} drafts accepted "
                  f"({out.acceptance_rate:.0%}), {out.num_steps} verifying forwards")
    return (f"[{out.num_new} new tokens in {total_s:.2f} s: {out.tokens_per_s:.1f} tokens/s (prefill of "
            f"{out.num_prompt} tokens + first token {out.prefill_s * 1000:.1f} ms{decode}){drafts}; "
            f"{'kv cache' if cache else 'no cache'}, {device.type}, {dtype}]")


def run_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """Evaluate a saved run's checkpoint at this job's process count; rank 0 prints the metrics and
    writes them to RUN_DIR/eval-<split>-step<N>.json."""
    from moetrain.cli.launch import launch, under_launcher

    if args.nproc and args.nproc > 1 and not under_launcher():
        return launch(args.nproc, args.argv)
    from moetrain.distributed import runtime
    from moetrain.train.evaluate import evaluate_run

    try:
        result = evaluate_run(args.run_dir, split=args.split, checkpoint=args.checkpoint)
    finally:
        runtime.shutdown()
    if result is not None:
        _print_eval(result, args.run_dir)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        runtime.exit_process(0)  # as train: skip a finalisation where late gloo threads abort a rank
    return 0


def _print_eval(result: dict, run_dir: str) -> None:
    split, where = result["split"], f"step {result['step']}, {result['world_size']} process(es)"
    if result["weights"] == "average":
        where += ", averaged weights"
    if f"{split}_accuracy" in result:
        print(f"{split} accuracy {result[f'{split}_accuracy']:.4f}  macro-F1 {result[f'{split}_macro_f1']:.4f}  "
              f"loss {result[f'{split}_loss']:.4f}  ({result[f'{split}_examples']} examples; {where})")
        names = _class_names(run_dir, len(result[f"{split}_per_class_f1"]))
        for name, f1 in zip(names, result[f"{split}_per_class_f1"], strict=False):
            print(f"  F1 {'-' if f1 is None else f'{f1:.4f}':>6s}  {name}")
    else:
        print(f"val loss {result['val_loss']:.4f}  perplexity {result['val_ppl']:.2f}  ({where})")
    print(f"written to {run_dir}/eval-{split}-step{result['step']}.json")


def _class_names(run_dir: str, num_classes: int) -> list[str]:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(run_dir) / "classes.json").read_text(encoding="utf-8"))["classes"]
    except (OSError, ValueError, KeyError):
        return [f"class {i}" for i in range(num_classes)]
