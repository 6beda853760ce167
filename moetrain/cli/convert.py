"""``moetrain export``, ``convert`` and ``upcycle``: getting models out of and into moetrain
(``moetrain.interop.export``, ``moetrain.interop.hf``, ``moetrain.interop.upcycle``).

    moetrain export RUN_DIR --to DIR [--max-shard-size 5GB]   (consolidated safetensors + config.yaml)
    moetrain convert RUN_DIR --to-hf DIR [--family F] [--fused] [--dtype bf16] [--max-shard-size 5GB]
                                   (Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V3)
    moetrain convert --from-hf DIR --to DIR          (a Hugging Face model and tokenizer as a moetrain export)
    moetrain upcycle --from-hf DENSE_DIR --num-experts E --top-k K --to DIR [--granularity G] [--noise STD]
                                                     (a dense Llama / Qwen3 as an MoE export, experts = its FFN)
"""

from __future__ import annotations

import argparse

CONVERT_DTYPES = ("fp32", "bf16", "fp16")


def _add_max_shard_size(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--max-shard-size", default=None,
                    help="split the safetensors into shards of at most this size (5GB, 500MiB) with an index")


def add_parsers(sub) -> None:
    exp = sub.add_parser("export", help="write a run's model as safetensors (one file, or shards past "
                                        "--max-shard-size) plus its config")
    exp.add_argument("run_dir",
                     help="run folder (its latest checkpoint), folder of checkpoints or one checkpoint")
    exp.add_argument("--to", required=True, help="output folder")
    _add_max_shard_size(exp)
    exp.set_defaults(func=run_export)

    conv = sub.add_parser("convert", help="Hugging Face MoE families <-> moetrain")
    conv.add_argument("source", nargs="?", default=None,
                      help="with --to-hf: a run folder, checkpoint or moetrain export")
    conv.add_argument("--to-hf", default=None, help="write a Hugging Face model folder here")
    conv.add_argument("--from-hf", default=None,
                      help="read this Hugging Face folder (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3)")
    conv.add_argument("--to", default=None, help="with --from-hf: the moetrain export folder to write")
    conv.add_argument("--family", default=None,
                      help="with --to-hf: the model_type to write where several families fit (default: the one "
                           "that fits)")
    conv.add_argument("--fused", action="store_true",
                      help="with --to-hf: experts as transformers-5 fused gate_up_proj/down_proj tensors "
                           "(default: per-expert tensors, what save_pretrained writes)")
    conv.add_argument("--dtype", default=None, choices=CONVERT_DTYPES,
                      help="cast the weights (what transformers keeps fp32 stays fp32: the router bias, and "
                           "DeepSeek-V3's router weight when its source is fp32); default: "
                           "fp32 on import, the source's dtypes on export")
    _add_max_shard_size(conv)
    conv.set_defaults(func=run_convert, parser=conv)
    up = sub.add_parser("upcycle", help="a dense Hugging Face Llama / Qwen3 model as an MoE whose experts start as "
                                        "its FFN, written as a moetrain export")
    up.add_argument("--from-hf", required=True, metavar="DENSE_DIR", help="the dense model's folder (llama, qwen3)")
    up.add_argument("--num-experts", type=int, required=True, help="experts E per MoE block (a multiple of G)")
    up.add_argument("--top-k", type=int, required=True,
                    help="experts per token K, >= 2 (a multiple of G); gates are renormalised")
    up.add_argument("--to", required=True, help="output export folder")
    up.add_argument("--granularity", type=int, default=1,
                    help="G: cut each dense FFN's hidden dim into G slices, experts of hidden F/G (default 1)")
    up.add_argument("--noise", type=float, default=0.0,
                    help="noise on every expert, as a fraction of each expert tensor's std (default 0: the MoE "
                         "computes the dense model's function)")
    up.add_argument("--seed", type=int, default=0, help="seed of the router and the noise")
    up.add_argument("--moe-every", type=int, default=1, help="MoE in every N-th block (default 1: all)")
    up.add_argument("--moe-layer-offset", type=int, default=0, help="first MoE block (default 0)")
    up.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of the written weights")
    _add_max_shard_size(up)
    up.set_defaults(func=run_upcycle)


def run_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.interop.export import export_model
    from moetrain.utils.safetensors_io import INDEX, WEIGHTS, parse_size

    out = export_model(args.run_dir, args.to, max_shard_bytes=parse_size(args.max_shard_size))
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    weights = f"{len(shards)} safetensors shards, {INDEX}" if shards else WEIGHTS
    tokenizer = ", tokenizer.json" if (out / "tokenizer.json").is_file() else ""
    print(f"exported {args.run_dir} to {out} ({weights}, config.yaml{tokenizer})")
    return 0


def run_upcycle(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from moetrain.interop.upcycle import upcycle_hf
    from moetrain.utils.safetensors_io import parse_size

    report = upcycle_hf(args.from_hf, args.to, num_experts=args.num_experts, top_k=args.top_k,
                        granularity=args.granularity, noise=args.noise, seed=args.seed, moe_every=args.moe_every,
                        moe_layer_offset=args.moe_layer_offset,
                        dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype],
                        max_shard_bytes=parse_size(args.max_shard_size))
    print(f"upcycled {args.from_hf} into the moetrain export {report.out}")
    for line in report.lines():
        print(f"  {line}")
    tokenizer = (f" --data.tokenizer={report.out / 'tokenizer.json'}" if "tokenizer.json" in report.tokenizer_files
                 else " --data.tokenizer=PATH/tokenizer.json")
    print(f"train it with: moetrain train --config {report.out / 'config.yaml'} --checkpoint.init_from={report.out}"
          f"{tokenizer} --data.corpus=... [--parallel.ep=N --nproc N] [--train.* ...]")
    return 0


def run_convert(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from moetrain.interop.hf import export_hf, import_hf
    from moetrain.utils.safetensors_io import parse_size

    dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    shard = parse_size(args.max_shard_size)
    if args.from_hf is not None:
        if args.source is not None or args.to_hf is not None or args.to is None or args.fused or args.family:
            args.parser.error("convert --from-hf HF_DIR takes --to DIR (a moetrain export) and no SOURCE, --to-hf, "
                         "--fused or --family (the family comes from config.json)")
        report = import_hf(args.from_hf, args.to, dtype=dtype or torch.float32, max_shard_bytes=shard)
        print(f"converted Hugging Face model {args.from_hf} to the moetrain export {report.out}")
    else:
        if args.source is None or args.to_hf is None or args.to is not None:
            args.parser.error("convert needs either SOURCE --to-hf DIR or --from-hf DIR --to DIR")
        report = export_hf(args.source, args.to_hf, family=args.family, fused=args.fused, dtype=dtype,
                           max_shard_bytes=shard)
        print(f"converted {args.source} to the Hugging Face folder {report.out} (config.json, safetensors)")
    for line in report.lines():
        print(f"  {line}")
    return 0
