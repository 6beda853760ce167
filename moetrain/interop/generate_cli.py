"""``moetrain generate``: text from a trained model, decoded one token per forward with a key/value
cache (``moetrain.train.generation.generate``), in one process.

    moetrain generate RUN --prompt "ROMEO:" [--max-new-tokens 100] [--temperature 0.8] [--top-k 50]
                      [--top-p 1.0] [--seed 0] [--checkpoint PATH] [--tokenizer tokenizer.json]
                      [--device auto|cpu|cuda] [--dtype fp32|bf16] [--no-cache] [--ignore-eos]

RUN is a run folder (its newest checkpoint), a checkpoint or a moetrain export, whatever parallel
layout wrote it (``moetrain.interop.export.load_source`` assembles full tensors). The tokenizer is
the run's (``data.tokenizer`` of its config, the BPE read from the data cache) or ``--tokenizer``
(a ``tokenizer.json``, or "bytes"), which an export of a Hugging Face model needs.

It prints the prompt and its continuation, then one line of figures: new tokens, seconds, tokens/s
overall and of the decoding steps after the first.

A model trained with a capacity factor generates dropless: capacity drops depend on every token of
a forward, later positions included, so they are not causal and no token-by-token decoding can
reproduce a full forward's; a token-choice router without a capacity is per token, so cached and
uncached decoding agree. An expert-choice model is refused: its experts pick tokens from the whole
batch. Wiring in ``moetrain/cli.py``: ``add_generate_parser(sub)`` in ``build_parser`` and
``return run_generate(args)`` for ``args.cmd == "generate"``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moetrain.config.convert import build_section
from moetrain.config.data import DataConfig
from moetrain.config.train import resolve_device
from moetrain.data.tokenizer import Tokenizer, build_tokenizer
from moetrain.interop.export import build_model, load_source, model_configs
from moetrain.models.transformer import Transformer
from moetrain.train.generation import Generation, generate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="continue a prompt with a trained model (key/value cache, one process)")
    p.add_argument("source", metavar="RUN", help="run folder (its newest checkpoint), checkpoint or moetrain export")
    p.add_argument("--prompt", required=True, help="text to continue (empty: start after an end-of-text token)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample from the K most likely tokens; 0 = all (default 50)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="then from the smallest set of them holding this probability; 1 = all (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--checkpoint", default=None, help="this checkpoint folder instead of RUN's newest")
    p.add_argument("--tokenizer", default=None,
                   help='a tokenizer.json, or "bytes" (default: the run\'s data.tokenizer)')
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when available, else CPU (default auto)")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="weights and cache dtype (default fp32)")
    p.add_argument("--no-cache", action="store_true",
                   help="a full forward over the whole sequence per token (the reference the cache reproduces)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-text token")
    return p


def run_generate(args) -> int:
    model, config = load_generation_model(args.checkpoint or args.source)
    tokenizer = load_tokenizer(config, args.tokenizer, source=args.source)
    require_vocab(tokenizer, model)
    device = resolve_device(args.device)
    model = model.to(device=device, dtype=DTYPES[args.dtype])
    ids = tokenizer.encode(args.prompt)
    if not ids:
        if tokenizer.eos_id is None:
            raise ValueError("--prompt ('') must not be empty with a tokenizer that has no end-of-text token")
        ids = [tokenizer.eos_id]  # the token stream puts it before every document but the first
    out = generate(model, torch.tensor([ids], device=device), max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k or None,
                   top_p=args.top_p if args.top_p < 1 else None, seed=args.seed, use_cache=not args.no_cache,
                   stop_id=None if args.ignore_eos else tokenizer.eos_id)
    print(tokenizer.decode(out.ids_BS[0].tolist()))
    print(figures_line(out, cache=not args.no_cache, device=device, dtype=args.dtype))
    return 0


def figures_line(out: Generation, *, cache: bool, device: torch.device, dtype: str) -> str:
    total_s = out.prefill_s + out.decode_s
    decode = f"; decode {out.decode_tokens_per_s:.1f} tokens/s" if out.num_new > 1 else ""
    return (f"[{out.num_new} new tokens in {total_s:.2f} s: {out.tokens_per_s:.1f} tokens/s (prefill of "
            f"{out.num_prompt} tokens + first token {out.prefill_s * 1000:.1f} ms{decode}); "
            f"{'kv cache' if cache else 'no cache'}, {device.type}, {dtype}]")


def load_generation_model(source: str) -> tuple[Transformer, dict]:
    """The model of ``source`` (fp32, CPU) and its config, made dropless (module docstring); a
    model that cannot generate is refused before any tokenizer work."""
    config, state_dict, _ = load_source(source)
    model_cfg, moe_cfg = model_configs(config)
    if model_cfg.is_moe and moe_cfg.capacity_factor is not None and not moe_cfg.is_expert_choice:
        print(f"moetrain generate: moe.capacity_factor {moe_cfg.capacity_factor} -> None: generation routes "
              "dropless (capacity drops look at later positions)", file=sys.stderr)
        config = {**config, "moe": {**config["moe"], "capacity_factor": None, "dynamic_capacity": False}}
        # The dynamic factor's buffer exists only with a capacity; it holds no weight.
        state_dict = {k: v for k, v in state_dict.items() if not k.endswith(".capacity_factor_now")}
    model = build_model(config, state_dict)
    model.check_generative()
    return model, config


def load_tokenizer(config: dict, tokenizer: str | None, *, source: str) -> Tokenizer:
    """``tokenizer`` (a tokenizer.json path or "bytes"), else the one the run's data section names."""
    if tokenizer is not None:
        if tokenizer != "bytes" and not tokenizer.endswith(".json"):
            raise ValueError(f'--tokenizer ({tokenizer!r}) must be a tokenizer.json or "bytes"')
        return build_tokenizer(tokenizer)
    if "data" not in config:
        raise ValueError(f"{source!r} holds no data config (an export of a Hugging Face model?): pass --tokenizer "
                         "PATH/tokenizer.json")
    from moetrain.data.prepare import prepare_data

    # The run's own tokenizer: a BPE is read from the data cache (trained and cached on first use).
    data = prepare_data(build_section(DataConfig, "data", config["data"]))
    if data.tokenizer is None:
        raise ValueError(f"{source!r} trained on pre-tokenised data (no tokenizer): pass --tokenizer "
                         "PATH/tokenizer.json")
    return data.tokenizer


def require_vocab(tokenizer: Tokenizer, model: Transformer) -> None:
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer's vocab_size ({tokenizer.vocab_size}) must be <= model.vocab_size "
                         f"({model.config.vocab_size}): it is not the tokenizer this model was trained with")
