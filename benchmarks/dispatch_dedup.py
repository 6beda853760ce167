"""All-to-all bytes of the per-copy dispatcher against once-per-rank sending (moe.dispatch_dedup),
for plain top-2 routing and for group-limited routing whose groups are the ep ranks.

    python benchmarks/dispatch_dedup.py [--steps 20]

Trains the demo model (the shipped `tiny` config, ep=2 on 2 processes) for a few steps per setting and
reads the bytes rank 0 sent and received (the dispatcher's own counters, forward exchanges of all
layers) from metrics.jsonl. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "top-2 (softmax)": [],
    "group-limited (2 groups = the 2 ranks, 1 per token)": ["--moe.num_expert_groups=2", "--moe.top_groups=1"],
}


def run(extra: list[str], steps: int, run_dir: Path) -> dict:
    subprocess.run([sys.executable, "-m", "moetrain.cli", "train", "--config", "tiny", "--nproc", "2",
                    f"--train.steps={steps}", f"--log.every={steps}", "--train.eval_every=0",
                    "--checkpoint.every=0", "--checkpoint.save_final=false", "--checkpoint.resume=never",
                    "--log.progress_bar=false", "--log.tensorboard=false", f"--log.run_dir={run_dir}", *extra],
                   cwd=ROOT, check=True, capture_output=True)
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {"mb_per_step": rec["a2a_bytes"] / steps / 2**20, "ratio": rec["a2a_bytes_ratio"], "loss": rec["loss"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    print("| routing | per-copy MB/step (rank 0) | once-per-rank MB/step | saved | loss after both (equal) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in SETTINGS.items():
            per_copy = run(extra, a.steps, Path(tmp) / f"{len(name)}a")
            dedup = run([*extra, "--moe.dispatch_dedup=true"], a.steps, Path(tmp) / f"{len(name)}b")
            saved = 1 - dedup["mb_per_step"] / per_copy["mb_per_step"]
            print(f"| {name} | {per_copy['mb_per_step']:.2f} | {dedup['mb_per_step']:.2f} | {saved:.0%} | "
                  f"{per_copy['loss']:.4f} / {dedup['loss']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
