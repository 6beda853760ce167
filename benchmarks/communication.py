"""Bytes on the wire per training step and the validation loss, per communication setting.

    python benchmarks/communication.py --json [--steps 300]

Trains the demo model (the shipped `tiny` config: ep=2 on 2 processes, fp32, D=128) for --steps
steps per setting, same seed and data, and reads from the run's metrics.jsonl (one record at the
last step, logged with the final validation loss):

* bytes_per_step: the bytes rank 0's expert all-to-alls sent plus received per step (the trainer's
  ``a2a_bytes``: the forward exchanges of every MoE layer, token rows with their fp8 scales and the
  routing metadata; backward repeats each token exchange in reverse, in bf16 for the bf16/fp8
  settings and in fp32 for the baseline);
* bytes_ratio_vs_fp32: those bytes over what fp32 rows need for the same routing (the trainer's
  ``a2a_bytes_ratio``: actual / the uncompressed minimum in the compute dtype, which is fp32 here);
* val_loss, and its ratio to the baseline's.

The forward dispatch alone (the part fp8 compresses; the combine stays bf16) is at (D + 4) / (4 D)
= 0.258 of fp32 at D=128; when the trainer logs ``a2a_dispatch_ratio_vs_fp32`` it is printed too.
The gradient-compression settings (dp.grad_compression) report, as bytes_per_step and
bytes_ratio_vs_fp32, what rank 0 moves per step to bring the data-parallel replicas together
(the trainer's ``grad_bytes`` and ``grad_bytes_ratio_vs_fp32``: all-reduces counted as ring
all-reduces, 2 x payload; the 1-bit exchange as its all-to-all send buffer plus all-gather output).
For onebit (1-bit Adam) that is a step of its 1-bit path, every step after its warmup (the
compressed momentum exchange, the trainer's ``grad_bytes_compressed_step``); the warmup steps
all-reduce fp32 gradients, so its rows add run_bytes_per_step and run_bytes_ratio_vs_fp32, the
average over the whole run warmup included, and onebit_warmup_steps. Every row also carries
grad_bytes_per_step and grad_bytes_ratio_vs_fp32 (whole-run averages) when the trainer logs them.
The default length is the demo's, 300 steps: the convergence target is set there.

    python benchmarks/communication.py --json --only fp32,bf16_grads,onebit_grads
    python benchmarks/communication.py --json --steps 300 --only onebit_grads --onebit-warmup 30,60,90
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moetrain.config.dp import DataParallelConfig

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "fp32"
SETTINGS = {  # name -> CLI overrides
    "fp32": [],
    "bf16_dispatch": ["--moe.dispatch_dtype=bf16"],
    "fp8_dispatch": ["--moe.dispatch_dtype=fp8_e4m3"],
    "bf16_grads": ["--dp.grad_compression=bf16"],
    "onebit_grads": ["--dp.grad_compression=onebit"],
}
GRAD_SETTINGS = {"bf16_grads", "onebit_grads"}
"""Settings whose bytes_per_step is the gradient reduction, not the expert all-to-all."""


def run(name: str, extra: list[str], steps: int, run_dir: Path) -> dict:
    """Train one setting; its row (last metrics record of the run)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "moetrain.cli", "train", "--config", "tiny", "--nproc", "2",
                    f"--train.steps={steps}", f"--log.every={steps}", f"--train.eval_every={steps}",
                    "--checkpoint.every=0", "--checkpoint.save_final=false", "--checkpoint.resume=never",
                    "--log.progress_bar=false", "--log.tensorboard=false", f"--log.run_dir={run_dir}", *extra],
                   cwd=ROOT, check=True, capture_output=True)
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["step"] == steps, rec
    row = {"setting": name, "steps": steps, "bytes_per_step": rec["a2a_bytes"] / steps,
           "bytes_ratio_vs_fp32": rec["a2a_bytes_ratio"], "val_loss": rec["val_loss"], "train_loss": rec["loss"],
           "seconds": round(time.monotonic() - t0, 1)}
    if "grad_bytes" in rec:  # already per step
        row.update(grad_bytes_per_step=rec["grad_bytes"], grad_bytes_ratio_vs_fp32=rec["grad_bytes_ratio_vs_fp32"])
    if name in GRAD_SETTINGS:
        row.update(bytes_per_step=rec["grad_bytes"], bytes_ratio_vs_fp32=rec["grad_bytes_ratio_vs_fp32"])
    if "grad_bytes_compressed_step" in rec:
        row.update(bytes_per_step=rec["grad_bytes_compressed_step"],
                   bytes_ratio_vs_fp32=rec["grad_bytes_ratio_vs_fp32_compressed_step"],
                   run_bytes_per_step=rec["grad_bytes"], run_bytes_ratio_vs_fp32=rec["grad_bytes_ratio_vs_fp32"])
    if "a2a_dispatch_ratio_vs_fp32" in rec:
        row["dispatch_bytes_ratio_vs_fp32"] = rec["a2a_dispatch_ratio_vs_fp32"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", action="store_true", help="one JSON object per setting and line")
    p.add_argument("--only", default=None, help=f"comma-separated settings to run ({BASELINE} always runs)")
    p.add_argument("--onebit-warmup", default=None,
                   help="comma-separated dp.onebit_warmup_steps: one onebit_grads run per value (default: the "
                        "config's default, 20%% of --steps)")
    a = p.parse_args()
    names = list(SETTINGS) if a.only is None else [BASELINE] + [n for n in a.only.split(",") if n != BASELINE]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    warmups = [int(w) for w in a.onebit_warmup.split(",")] if a.onebit_warmup else [None]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for warmup in warmups if name == "onebit_grads" else [None]:
                extra = SETTINGS[name] + ([f"--dp.onebit_warmup_steps={warmup}"] if warmup is not None else [])
                row = run(name, extra, a.steps, Path(tmp) / f"{name}{warmup or ''}")
                if name == "onebit_grads":
                    default = DataParallelConfig().onebit_warmup(a.steps)
                    row["onebit_warmup_steps"] = warmup if warmup is not None else default
                rows.append(row)
    base = next(r for r in rows if r["setting"] == BASELINE)
    for r in rows:
        r["val_loss_ratio_vs_baseline"] = r["val_loss"] / base["val_loss"]
        if a.json:
            print(json.dumps(r), flush=True)
    if not a.json:
        print("| setting | bytes/step (rank 0: a2a, or grad reduce for *_grads) | vs fp32 | val loss | vs baseline |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['setting']} | {r['bytes_per_step']:,.0f} | {r['bytes_ratio_vs_fp32']:.3f} | "
                  f"{r['val_loss']:.4f} | {r['val_loss_ratio_vs_baseline']:.4f} |")


if __name__ == "__main__":
    main()
