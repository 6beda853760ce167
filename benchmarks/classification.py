"""The classification results table: test accuracy, macro-F1, samples/s and wall time of the dense
model, the MoE model on 1 process and the MoE model with ep=2 on 2 processes, per data set.

    python benchmarks/classification.py --task thucnews          (about 3 x 30 min on 2 quiet cores)
    python benchmarks/classification.py --task r8 --json
    python benchmarks/classification.py --task thucnews --only moe --steps 200   (a quick check)

Each row runs the exact command it prints (`moetrain train --config <shipped config>`, with
``--log.run_dir`` in a temporary folder), then `moetrain eval RUN` on its checkpoint, and reads:

* test_accuracy / test_macro_f1: the run's final evaluation over the whole test split (last record of
  metrics.jsonl), checked equal to what `moetrain eval` prints from the saved checkpoint;
* samples_per_s: training examples per second, the mean over the run's log windows (evaluation and
  checkpoint time excluded); wall_s: the whole command, data preparation and evaluation included;
* load_1m: the 1-minute load average (``os.getloadavg``) when the run ended: the machine is shared, and
  a load above the core count inflates wall_s.

The dense configs have the same active parameters per token as the MoE ones (dense hidden dim =
top_k * expert hidden dim) and train the same steps on the same batches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {  # task -> row name -> (shipped config, processes)
    "thucnews": {"dense": ("thucnews-dense", 1), "moe": ("thucnews", 1), "moe_ep2": ("thucnews-ep2", 2)},
    "r8": {"dense": ("r8-dense", 1), "moe": ("r8", 1), "moe_ep2": ("r8-ep2", 2)},
}


def _records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_row(config: str, nproc: int, run_dir: Path, extra: list[str]) -> dict:
    """Train one row's config and evaluate its checkpoint; the row's figures."""
    command = [sys.executable, "-m", "moetrain.cli", "train", "--config", config, *extra]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    shown = " ".join(["moetrain", *command[3:]])
    t0 = time.perf_counter()
    subprocess.run([*command, f"--log.run_dir={run_dir}"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]
    records = _records(run_dir)
    final = records[-1]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r]
    evaluated = subprocess.run([sys.executable, "-m", "moetrain.cli", "eval", str(run_dir)], check=True, cwd=ROOT,
                               capture_output=True, text=True).stdout
    printed = f"test accuracy {final['test_accuracy']:.4f}"
    return {"command": shown, "steps": final["step"], "test_accuracy": final["test_accuracy"],
            "test_macro_f1": final["test_macro_f1"], "val_accuracy": final["val_accuracy"],
            "samples_per_s": sum(rates) / len(rates), "wall_s": wall, "load_1m": load,
            "eval_matches": printed in evaluated}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(ROWS), default="thucnews")
    p.add_argument("--only", default=None, help="comma-separated rows: " + ", ".join(ROWS["thucnews"]))
    p.add_argument("--steps", type=int, default=None, help="override train.steps (quick checks)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    args = p.parse_args()
    rows = ROWS[args.task]
    names = args.only.split(",") if args.only else list(rows)
    extra = [f"--train.steps={args.steps}"] if args.steps else []
    results = {}
    with tempfile.TemporaryDirectory(prefix="moetrain-classify-") as tmp:
        for name in names:
            config, nproc = rows[name]
            results[name] = run_row(config, nproc, Path(tmp) / name, extra)
            if args.json:
                print(json.dumps({"row": name, **results[name]}), flush=True)
    if not args.json:
        print(f"| {args.task} | test accuracy | macro-F1 | samples/s | wall s | load (1 min) | command |")
        print("|---|---|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['test_accuracy']:.4f} | {r['test_macro_f1']:.4f} | {r['samples_per_s']:.0f} | "
                  f"{r['wall_s']:.0f} | {r['load_1m']:.1f} | `{r['command']}` |")
    if not all(r["eval_matches"] for r in results.values()):
        print("moetrain eval printed another test accuracy than a run's final evaluation", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
