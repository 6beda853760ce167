"""Skewed routing workloads (moe.force_skew) against forced balance, at ep=2 and ep=4, in one run.

    python benchmarks/skew.py [--steps 8] [--json] [--rebalance] [--ep 2 4] [--skews zipf:1.2 ...]
                              [--capacities dropless capacity1.25] [--repeats 1] [--model small | wide]

For each ep in (2, 4) (that many CPU gloo processes, dp = ep), each capacity setting (dropless, and
moe.capacity_factor 1.25) and each routing (balanced = moe.force_balance round_robin, exactly T*K/E
copies per expert; zipf:1.2; hot:1:0.5; drift:1.2:3), trains a small MoE model (2 layers, dim 64, 8
experts top-2, 16 sequences of 64 tokens per step, fp32) for ``--steps`` steps and reads:

* max_over_mean_tokens: routed copies received by each ep rank's experts (the counts routing trace,
  before capacity drops), max rank / mean rank, averaged over steps and layers;
* step time: from a second run of the same job without the memory tracker (its per-operation Python
  hook would be most of a step of this model) and logging every ``TIMING_LOG_EVERY`` steps as a
  user would: the median ``step_time_s`` of its windows after the first (warm-up);
* peak memory: ``mem/peak_bytes`` of rank 0 (the tracker's peak of params + grads + optimizer +
  activations; steps 3-8, with rebalancing the steps after the first plan), which hosts experts
  0..E/ep-1: the hottest rank under zipf and hot (under drift the hot expert moves over the ranks);

and prints each as a ratio to the balanced run of the same ep and capacity setting.

``--model wide`` trains the same model at dim 128, expert hidden 512 and 128-token sequences (8x the
expert FLOPs per token, twice the tokens): the small model's step is mostly the host's dispatch of its
operations, so a skew moves it by a few percent; the wide one's expert GEMMs are most of its step, as
at real widths on GPUs, so the hot rank's extra work (and what rebalancing takes off it) shows.

``--rebalance`` adds, for each ep, rows with expert rebalancing (settings "... rebalance":
parallel.expert_slots_per_rank = E/ep + 1, one spare slot per rank, moe.rebalance_every 4) on
zipf:1.2 (dropless and capacity 1.25) and on a recorded trace ("trace": the full routing trace of
an unforced run of the same model, aux loss off, recorded first; its row without rebalancing too).
Their max_over_mean_tokens is measured from the copies each ep rank's slots received (the
rebalancer's ``rebalance.jsonl``, after capacity drops) over the steps after the first plan, and
``max_over_mean_before`` over the steps before it (the home layout); migration_bytes is the
replica traffic of one step over all ranks (each replica's weights out and gradient home), which
a re-plan does not add to (homes and optimizer state never move), and migration_s the median
seconds of rank 0's ``after_step`` on re-planning steps (plan, and starting the weight refresh). Without it,
migration_bytes is 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from functools import partial
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


WIDE = ["--model.dim=128", "--moe.expert_hidden_dim=512", "--model.max_seq_len=128", "--data.seq_len=128"]
"""Overrides of ``--model wide``: the expert GEMMs most of the step."""
REBALANCE_EVERY = 4
TIMING_STEPS, TIMING_LOG_EVERY = 25, 5
"""The timing run: 5 windows of 5 steps, the first one (warm-up, the first re-plan) left out."""


def _train(run_dir: Path, ep: int, args: list[str]) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "moetrain.cli", "train", "--nproc", str(ep), *MODEL, *args,
                    f"--parallel.ep={ep}", f"--train.micro_batch_size={16 // ep}", f"--log.run_dir={run_dir}"],
                   cwd=ROOT, check=True, capture_output=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def timed_step_s(run_dir: Path, ep: int, args: list[str], repeats: int = 1) -> float:
    """Median seconds per step of the job ``args`` over ``TIMING_STEPS`` steps, measured without the
    memory tracker, logging every ``TIMING_LOG_EVERY`` steps, the first window left out; with
    ``repeats`` > 1, the median of that many runs' medians."""
    medians = []
    for _ in range(repeats):
        _train(run_dir, ep, [*args, f"--train.steps={TIMING_STEPS}", f"--log.every={TIMING_LOG_EVERY}",
                             "--log.memory=false"])
        medians.append(timed_windows_median(run_dir))
    return statistics.median(medians)


def timed_windows_median(run_dir: Path) -> float:
    """The median ``step_time_s`` of a timing run's windows after the first."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return statistics.median(r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > TIMING_LOG_EVERY)


def _run(name: str, *, ep: int, steps: int, routing: list[str], capacity: float | None,
         extra: tuple[str, ...] = (), timed: bool = True, repeats: int = 1, width: tuple[str, ...] = ()) -> dict:
    from moetrain.train.routing_trace import rank_loads, straggler_factors

    run_dir = ROOT / "runs" / f"bench-skew{'-wide' if width else ''}-{name}"
    args = [*width, *routing, *([] if capacity is None else [f"--moe.capacity_factor={capacity}"]), *extra]
    # The peak after the first re-plan when rebalancing (before it the home layout runs, bank and all).
    first = REBALANCE_EVERY if extra else 2
    recs = [r for r in _train(run_dir, ep, [*args, f"--train.steps={steps}"]) if "loss" in r and r["step"] > first]
    _, _, load_SLGP = rank_loads(run_dir)
    out = {"max_over_mean_tokens": float(straggler_factors(load_SLGP).mean()),
           "peak_bytes": max(r["mem/peak_bytes"] for r in recs if "mem/peak_bytes" in r), "run_dir": run_dir}
    if timed:
        out["step_time_s"] = timed_step_s(run_dir.with_name(run_dir.name + "-timing"), ep, args, repeats)
    if (run_dir / "rebalance.jsonl").exists():
        out.update(_rebalance_figures(run_dir / "rebalance.jsonl"))
    return out


def _rebalance_figures(path: Path) -> dict:
    """Max/mean copies per rank before and after the first plan, replica bytes per step, and the
    seconds of a re-planning step's after_step."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line]

    def straggler(rows: list[dict]) -> float:
        ratios = [max(c) / (sum(c) / len(c)) for r in rows for c in r["rank_copies"] if sum(c) > 0]
        return statistics.mean(ratios)

    return {"max_over_mean_tokens": straggler([r for r in recs if r["step"] > REBALANCE_EVERY]),
            "max_over_mean_before": straggler([r for r in recs if r["step"] <= REBALANCE_EVERY]),
            "migration_bytes": statistics.median(r["replica_bytes"] for r in recs if r["step"] > 1),
            "migration_s": statistics.median(r["after_step_s"] for r in recs if r["rebalanced"])}


def _rebalance_runs(ep: int, steps: int, capacities: list[str], repeats: int,
                    width: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(setting, figures) of the rebalanced runs at ``ep`` and the unrebalanced trace run (the
    capacity row only with "capacity1.25" in ``capacities``)."""
    extra = (f"--parallel.expert_slots_per_rank={8 // ep + 1}", f"--moe.rebalance_every={REBALANCE_EVERY}")
    # Long enough for the timing run's replay too.
    recorded = _run(f"ep{ep}-record", ep=ep, steps=max(steps, TIMING_STEPS), routing=["--log.routing_trace=full"],
                    capacity=None, timed=False, width=width)
    trace = [f"--moe.force_skew=trace:{recorded['run_dir']}"]
    zipf = ["--moe.force_skew=zipf:1.2"]
    run = partial(_run, ep=ep, steps=steps, repeats=repeats, width=width)
    rows = [("zipf:1.2 dropless rebalance", run(f"ep{ep}-zipf-rebalance", routing=zipf, capacity=None, extra=extra))]
    if "capacity1.25" in capacities:
        rows.append(("zipf:1.2 capacity1.25 rebalance", run(f"ep{ep}-zipf-cap-rebalance", routing=zipf,
                                                            capacity=1.25, extra=extra)))
    rows.append(("trace dropless", run(f"ep{ep}-trace", routing=trace, capacity=None)))
    rows.append(("trace dropless rebalance", run(f"ep{ep}-trace-rebalance", routing=trace, capacity=None,
                                                 extra=extra)))
    return rows


def _row(setting: str, ep: int, got: dict, base: dict) -> dict:
    row = {"setting": setting, "ep": ep, "max_over_mean_tokens": round(got["max_over_mean_tokens"], 3),
           "step_time_ratio_vs_balanced": round(got["step_time_s"] / base["step_time_s"], 3),
           "peak_memory_ratio_vs_balanced": round(got["peak_bytes"] / base["peak_bytes"], 3),
           "migration_bytes": int(got.get("migration_bytes", 0)), "step_time_s": round(got["step_time_s"], 4),
           "peak_bytes": got["peak_bytes"]}
    if "max_over_mean_before" in got:
        row.update(max_over_mean_before=round(got["max_over_mean_before"], 3),
                   migration_s=round(got["migration_s"], 4))
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--rebalance", action="store_true", help="add the expert-rebalancing rows")
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    p.add_argument("--skews", nargs="+", default=list(SKEWS), choices=SKEWS, help="the skews without rebalancing")
    p.add_argument("--capacities", nargs="+", default=list(CAPACITY), choices=list(CAPACITY))
    p.add_argument("--repeats", type=int, default=1, help="timing runs per job (the median of their medians)")
    p.add_argument("--model", choices=("small", "wide"), default="small",
                   help="the small model, or the same at 8x the expert work per token (see the docstring)")
    a = p.parse_args()
    width = tuple(WIDE) if a.model == "wide" else ()
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        if a.json:
            print(json.dumps(row), flush=True)

    if a.rebalance and "dropless" not in a.capacities:
        p.error("--rebalance needs the dropless capacity setting (its balanced run is the rows' base)")
    for ep in a.ep:
        bases: dict[str, dict] = {}
        run = partial(_run, ep=ep, steps=a.steps, repeats=a.repeats, width=width)
        for cap_name in a.capacities:
            capacity = CAPACITY[cap_name]
            base = bases[cap_name] = run(f"ep{ep}-{cap_name}-balanced", routing=["--moe.force_balance=round_robin"],
                                         capacity=capacity)
            for skew in ("balanced", *a.skews):
                got = base if skew == "balanced" else run(f"ep{ep}-{cap_name}-{skew.replace(':', '_')}",
                                                          routing=[f"--moe.force_skew={skew}"], capacity=capacity)
                emit(_row(f"{skew} {cap_name}", ep, got, base))
        if a.rebalance:
            for setting, got in _rebalance_runs(ep, a.steps, a.capacities, a.repeats, width):
                emit(_row(setting, ep, got, bases["capacity1.25" if "capacity" in setting else "dropless"]))
    if not a.json:
        print("| setting | ep | max/mean rank tokens | step time vs balanced | peak memory vs balanced | step s "
              "| migration bytes |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['setting']} | {r['ep']} | {r['max_over_mean_tokens']} | {r['step_time_ratio_vs_balanced']} "
                  f"| {r['peak_memory_ratio_vs_balanced']} | {r['step_time_s']} | {r['migration_bytes']} |")


if __name__ == "__main__":
    main()
