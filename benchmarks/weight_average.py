"""What optim.ema_decay costs per step: the weight-average update (one fused lerp over the weights)
against the AdamW step it follows, on the same model, in one process.

    OMP_NUM_THREADS=1 python benchmarks/weight_average.py [--config tiny] [--repeats 30]

Both are memory-bound elementwise passes over the weights: AdamW reads the weight, its gradient and
two moments and writes three of them back; the average reads two tensors and writes one. Prints the
median seconds of each over ``--repeats`` timed calls and their ratio, plus the average's bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from moetrain.config.loader import load_config
from moetrain.models.transformer import Transformer
from moetrain.train.optim import build_optimizer
from moetrain.train.weight_average import WeightAverage


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: AdamW allocates its moments on the first step
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    cfg = load_config(a.config)
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab)
    model = Transformer(model_cfg, moe=cfg.moe if model_cfg.is_moe else None, seed=0)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    o = cfg.optim
    optimizer = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps)
    ema = WeightAverage(model, decay=0.999)
    adam_s = _median_s(optimizer.step, a.repeats)
    ema_s = _median_s(ema.update, a.repeats)
    numel = sum(q.numel() for q in params)
    avg_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in ema.state_dict().values()}.values())
    print(f"config {a.config}: {numel / 1e6:.2f}M trainable weights, {torch.get_num_threads()} thread(s)")
    print(f"AdamW step            {adam_s * 1e3:8.2f} ms (median of {a.repeats})")
    print(f"weight-average update {ema_s * 1e3:8.2f} ms")
    print(f"ratio update / step   {ema_s / adam_s:8.3f}")
    print(f"average bytes         {avg_bytes / 2**20:8.2f} MiB ({avg_bytes / numel:.0f} per weight)")


if __name__ == "__main__":
    main()
