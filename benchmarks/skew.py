"""Skewed routing workloads (moe.force_skew) against forced balance, at ep=2 and ep=4, in one run.

    python benchmarks/skew.py [--steps 8] [--json]

For each ep in (2, 4) (that many CPU gloo processes, dp = ep), each capacity setting (dropless, and
moe.capacity_factor 1.25) and each routing (balanced = moe.force_balance round_robin, exactly T*K/E
copies per expert; zipf:1.2; hot:1:0.5; drift:1.2:3), trains a small MoE model (2 layers, dim 64, 8
experts top-2, 16 sequences of 64 tokens per step, fp32) for ``--steps`` steps and reads:

* max_over_mean_tokens: routed copies received by each ep rank's experts (the counts routing trace,
  before capacity drops), max rank / mean rank, averaged over steps and layers;
* step time: median ``step_time_s`` of the logged steps after the first two (warm-up);
* peak memory: ``mem/peak_bytes`` of rank 0 (the tracker's peak of params + grads + optimizer +
  activations), which hosts experts 0..E/ep-1: the hottest rank under zipf and hot (under drift the
  hot expert moves over the ranks);

and prints each as a ratio to the balanced run of the same ep and capacity setting.
migration_bytes is 0: no expert rebalancing (issue 33 part 4) exists yet.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SKEWS = ("zipf:1.2", "hot:1:0.5", "drift:1.2:3")
CAPACITY = {"dropless": None, "capacity1.25": 1.25}
MODEL = ["--model.dim=64", "--model.num_layers=2", "--model.num_heads=4", "--model.max_seq_len=64",
         "--moe.num_experts=8", "--moe.top_k=2", "--moe.expert_hidden_dim=128", "--data.corpus=shakespeare",
         "--data.tokenizer=bytes", "--data.seq_len=64", "--train.global_batch_size=16", "--train.eval_every=0",
         "--train.device=cpu", "--checkpoint.every=0", "--checkpoint.save_final=false", "--log.every=1",
         "--log.progress_bar=false", "--log.tensorboard=false", "--moe.aux_loss_coef=0"]


def _run(name: str, *, ep: int, steps: int, routing: list[str], capacity: float | None) -> dict:
    from moetrain.train.routing_trace import rank_loads, straggler_factors

    run_dir = ROOT / "runs" / f"bench-skew-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cap = [] if capacity is None else [f"--moe.capacity_factor={capacity}"]
    micro = 16 // ep
    subprocess.run([sys.executable, "-m", "moetrain.cli", "train", "--nproc", str(ep), *MODEL, *routing, *cap,
                    f"--parallel.ep={ep}", f"--train.micro_batch_size={micro}", f"--train.steps={steps}",
                    f"--log.run_dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    recs = [r for r in recs if "loss" in r and r["step"] > 2]
    _, _, load_SLP = rank_loads(run_dir)
    return {"max_over_mean_tokens": float(straggler_factors(load_SLP).mean()),
            "step_time_s": statistics.median(r["step_time_s"] for r in recs),
            "peak_bytes": max(r["mem/peak_bytes"] for r in recs if "mem/peak_bytes" in r)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    a = p.parse_args()
    rows = []
    for ep in (2, 4):
        for cap_name, capacity in CAPACITY.items():
            base = _run(f"ep{ep}-{cap_name}-balanced", ep=ep, steps=a.steps,
                        routing=["--moe.force_balance=round_robin"], capacity=capacity)
            for skew in ("balanced", *SKEWS):
                got = base if skew == "balanced" else _run(
                    f"ep{ep}-{cap_name}-{skew.replace(':', '_')}", ep=ep, steps=a.steps,
                    routing=[f"--moe.force_skew={skew}"], capacity=capacity)
                rows.append({"setting": f"{skew} {cap_name}", "ep": ep,
                             "max_over_mean_tokens": round(got["max_over_mean_tokens"], 3),
                             "step_time_ratio_vs_balanced": round(got["step_time_s"] / base["step_time_s"], 3),
                             "peak_memory_ratio_vs_balanced": round(got["peak_bytes"] / base["peak_bytes"], 3),
                             "migration_bytes": 0, "step_time_s": round(got["step_time_s"], 4),
                             "peak_bytes": got["peak_bytes"]})
                if a.json:
                    print(json.dumps(rows[-1]), flush=True)
    if not a.json:
        print("| setting | ep | max/mean rank tokens | step time vs balanced | peak memory vs balanced | step s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['setting']} | {r['ep']} | {r['max_over_mean_tokens']} | {r['step_time_ratio_vs_balanced']} "
                  f"| {r['peak_memory_ratio_vs_balanced']} | {r['step_time_s']} |")


if __name__ == "__main__":
    main()
