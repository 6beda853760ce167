"""Memory of LoRA fine-tuning against full fine-tuning, one process, same model, same batch.

    .venv/bin/python benchmarks/lora_memory.py                  # CPU, Mixtral-8x7B shape ratios at dim 256
    .venv/bin/python benchmarks/lora_memory.py --device cuda    # also torch.cuda.max_memory_allocated

The model keeps Mixtral-8x7B's ratios (8 experts top-2, SwiGLU, expert hidden 3.5 x dim, 4:1
grouped-query heads) at dim 256, 4 blocks. Full fine-tuning trains every parameter with AdamW;
LoRA (rank 8, alpha 16) trains adapters on the attention projections and the routed experts
(stored per expert, grouped) with the base weights frozen. For each: the model states after a
step, counted exactly (``model_state_bytes``: parameters, gradients, AdamW states), and the
measured peak of one training step (``MemoryTracker``: every tensor storage the step allocates,
activations included); on CUDA also the allocator's peak. Step times are medians of the timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.finetune import FinetuneConfig
from moetrain.models.lora import apply_lora, num_lora_params
from moetrain.models.transformer import Transformer
from moetrain.train.optim import build_optimizer
from moetrain.utils.memory import MemoryTracker, model_state_bytes

DIM, LAYERS, VOCAB, SEQ, MICRO = 256, 4, 2048, 256, 4


def configs() -> tuple[ModelConfig, MoEConfig]:
    model = ModelConfig(dim=DIM, num_layers=LAYERS, num_heads=8, num_kv_heads=2, vocab_size=VOCAB,
                        max_seq_len=SEQ, activation="swiglu")
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=DIM * 7 // 2, activation="swiglu")
    return model, moe


def measure(finetune: FinetuneConfig, device: torch.device, *, steps: int) -> dict:
    model_cfg, moe = configs()
    model = apply_lora(Transformer(model_cfg, moe=moe, seed=0), finetune, seed=1).to(device)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.randint(0, VOCAB, (steps + 2, MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times, tracked = [], None
    for step in range(steps + 2):
        x = tokens[step].to(device)
        tracker = MemoryTracker(model, opt) if step == 1 else None  # after the states exist
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if tracker is not None:
            tracker.__enter__()
        out = model(x[:, :-1], x[:, 1:])
        out.total_loss.backward()
        del out
        opt.step()
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tracked = tracker.report()
        states = model_state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
        cuda_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "lora": num_lora_params(model), "states": states,
            "peak": tracked, "cuda_peak": cuda_peak, "step_s": statistics.median(times)}


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after 2 untimed)")
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    full = measure(FinetuneConfig(), device, steps=args.steps)
    lora = measure(FinetuneConfig(lora_rank=args.rank, lora_alpha=2.0 * args.rank,
                                  lora_targets=("attention", "experts")), device, steps=args.steps)
    print(f"model: {full['total'] / 1e6:.2f}M parameters (Mixtral-8x7B ratios at dim {DIM}, {LAYERS} blocks), "
          f"{MICRO} x {SEQ} tokens per step, fp32, AdamW, {device}")
    print(f"LoRA rank {args.rank} on attention + routed experts: {lora['trainable'] / 1e6:.3f}M trainable "
          f"({100 * lora['trainable'] / lora['total']:.2f}% of {lora['total'] / 1e6:.2f}M)\n")
    print("| | full fine-tuning | LoRA | LoRA / full |")
    print("|---|---|---|---|")
    rows = [("parameters (MiB)", full["states"]["param_bytes"], lora["states"]["param_bytes"]),
            ("gradients after backward (MiB)", full["peak"].grad_bytes, lora["peak"].grad_bytes),
            ("AdamW states (MiB)", full["states"]["optim_bytes"], lora["states"]["optim_bytes"])]
    p_g_o = [sum(r[i] for r in rows) for i in (1, 2)]
    rows.append(("params + grads + AdamW (MiB)", *p_g_o))
    rows.append(("measured step peak, all tensors (MiB)", full["peak"].peak_bytes, lora["peak"].peak_bytes))
    rows.append(("  of which activations (MiB)", full["peak"].activation_peak_bytes,
                 lora["peak"].activation_peak_bytes))
    if full["cuda_peak"] is not None:
        rows.append(("torch.cuda.max_memory_allocated (MiB)", full["cuda_peak"], lora["cuda_peak"]))
    for label, full_bytes, lora_bytes in rows:
        print(f"| {label} | {mib(full_bytes)} | {mib(lora_bytes)} | {lora_bytes / full_bytes:.3f} |")
    print(f"| step time, median of {args.steps} (s) | {full['step_s']:.3f} | {lora['step_s']:.3f} "
          f"| {lora['step_s'] / full['step_s']:.3f} |")


if __name__ == "__main__":
    main()
