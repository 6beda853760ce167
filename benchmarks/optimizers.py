"""AdamW against Muon (optim.name) on the demo model, at equal steps, in one run.

    python benchmarks/optimizers.py [--steps 100] [--nproc 2]

Trains the shipped ``tiny`` config (``make demo``'s: 8 experts top-2, ep=2 on 2 processes, fp32,
lr 1e-3 with 30 warmup steps then cosine) once per optimizer, same seed and data, for ``--steps``
steps (100 by default, a third of the demo's 300, so that both runs fit in about 5 minutes on 2
cores; the cosine schedule ends at ``--steps``). Muon takes the same lr and weight decay: its
updates are scaled to AdamW's RMS (``moetrain.distributed.muon``). Prints, per optimizer, the
validation loss at the last step (the config's 4 validation batches), the last logged training loss,
the median tokens/s over the logged steps, and the wall time of the run. Tokens/s on a shared
CPU is noisy, so the optimizer step itself is also timed, in this process with one thread: the median
of ``--repeats`` steps of each optimizer over the whole demo model (all 8 experts; a rank at ep=2
steps half of them) on fixed random gradients.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon")


def _train(name: str, *, steps: int, nproc: int) -> dict:
    run_dir = ROOT / "runs" / f"bench-optim-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of the last one
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moetrain.cli", "train", "--config", "tiny", "--nproc", str(nproc),
                    f"--optim.name={name}", f"--train.steps={steps}", f"--train.eval_every={steps}",
                    "--checkpoint.every=0", "--checkpoint.save_final=false", "--log.progress_bar=false",
                    f"--log.run_dir={run_dir}"], cwd=ROOT, check=True)
    seconds = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    val = [r for r in recs if "val_loss" in r][-1]
    train = [r for r in recs if "loss" in r][-1]
    return {"optimizer": name, "steps": val["step"], "val_loss": val["val_loss"], "train_loss": train["loss"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs if "tokens_per_s" in r),
            "seconds": round(seconds, 1)}


def _step_ms(name: str, *, repeats: int) -> float:
    """Median milliseconds of one ``name`` step over the demo model's parameters (module docstring)."""
    import dataclasses

    import torch

    from moetrain.config.loader import load_config
    from moetrain.models.transformer import Transformer
    from moetrain.train.optim import build_optimizer, optimizer_settings

    cfg = load_config("tiny", [f"--optim.name={name}"])
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size), moe=cfg.moe, seed=0)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    optimizer = build_optimizer(model, **optimizer_settings(cfg.optim))
    optimizer.step()  # the states are allocated in the first step
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    rows = [_train(name, steps=a.steps, nproc=a.nproc) for name in OPTIMIZERS]
    import torch

    torch.set_num_threads(1)
    for row in rows:
        row["optimizer_step_ms"] = round(_step_ms(row["optimizer"], repeats=a.repeats), 2)
    for row in rows:
        print(json.dumps(row))
    print("| optimizer | steps | val loss | train loss | tokens/s (median) | wall s | optimizer step ms (1 thread) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['steps']} | {r['val_loss']:.4f} | {r['train_loss']:.4f} | "
              f"{r['tokens_per_s']:,.0f} | {r['seconds']} | {r['optimizer_step_ms']} |")


if __name__ == "__main__":
    main()
