"""MoE vs a dense model with the same active parameters: same data, steps and layout.

    python benchmarks/moe_vs_dense.py            # trains the shipped configs tiny and tiny-dense (2 procs each)
    python benchmarks/moe_vs_dense.py --no-train # only tabulate runs/tiny and runs/tiny-dense

Prints a Markdown table: final val loss / perplexity and the median tokens/s over the logged steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"MoE (tiny: 8 experts, top-2)": ("tiny", "runs/tiny"),
        "dense (tiny-dense: FFN 512)": ("tiny-dense", "runs/tiny-dense")}
"""Table row -> (shipped config name, run folder under the repository root)."""


def _params(run_dir: Path) -> tuple[float, float]:
    from moetrain.config.loader import config_from_dict
    from moetrain.models.transformer import count_params

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    pc = count_params(cfg.model, cfg.moe, vocab_size=vocab)
    return pc.total / 1e6, pc.active / 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    rows = []
    for name, (config, run_dir) in RUNS.items():
        if not a.no_train:
            subprocess.run([sys.executable, "-m", "moetrain.cli", "train", "--config", config, "--nproc", str(a.nproc),
                            "--log.progress_bar=false", f"--log.run_dir={run_dir}"], cwd=ROOT, check=True)
        recs = [json.loads(line) for line in (ROOT / run_dir / "metrics.jsonl").read_text().splitlines() if line]
        val = [r for r in recs if "val_loss" in r][-1]
        tps = statistics.median(r["tokens_per_s"] for r in recs)
        total, active = _params(ROOT / run_dir)
        rows.append((name, total, active, val["step"], val["val_loss"], val["val_ppl"], tps))
    print("| model | params (total / active per token) | steps | val loss | val perplexity | tokens/s (median) |")
    print("|---|---|---|---|---|---|")
    for name, total, active, step, vl, ppl, tps in rows:
        print(f"| {name} | {total:.2f}M / {active:.2f}M | {step} | {vl:.3f} | {ppl:.1f} | {tps:,.0f} |")


if __name__ == "__main__":
    main()
