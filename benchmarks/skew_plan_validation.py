"""The skew planner (``moetrain plan --skew``) against measured runs at ep=2 and ep=4 on CPU processes.

    python benchmarks/skew_plan_validation.py [--steps 8] [--repeats 3] [--recalibrate | --calibration FILE] [--json]
                                             [--model small | wide]

The model of benchmarks/skew.py (2 MoE layers of 8 experts top-2, dim 64, expert hidden 128, 16
sequences x 64 tokens per step, fp32, aux loss off), dp = ep = 2 and 4 gloo processes. Without
``--calibration`` it first measures this machine (``moetrain.plan.calibrate`` on the model's shapes,
at 2 and 4 processes). Then per ep: forced balance (round_robin) and ``moe.force_skew`` zipf:1.2 and
hot:1:0.5 dropless, and zipf:1.2 at capacity factor 1.25, each trained ``--steps`` steps, and the
plan of the same layout and skew (``plan.skew.make_skew_plan``) beside. ``--model wide`` trains the same
model at dim 128, expert hidden 512 and 128-token sequences (8x the expert FLOPs per token and twice
the tokens): the small model's step is mostly the host's dispatch of its operations, so the skew's
extra expert work on the hottest rank is a few percent of it; the wide one's expert GEMMs are most
of its step, as on a GPU at real widths, and the skew moves its step by a quarter.

* tokens: the hottest ep rank's routed copies per micro-batch before capacity drops (the counts
  routing trace; mean over steps and layers) against the plan's expected copies of its dropless
  row, and the dropped fraction (``dropped_fraction``, mean over steps and layers) against the
  plan's;
* step time: ``benchmarks.skew.timed_step_s``, a second run of the job without the memory tracker
  (its per-operation Python hook would be most of a step of this model), logging every 5 steps,
  the median ``step_time_s`` of its 5-step windows after the first (with ``--repeats`` N, the median
  of N such runs' medians: whole runs of this host-bound model differ by up to 1.5x), against the
  plan's step; ``--recalibrate`` measures each ep's process count again right before its rows, so a
  machine whose speed drifts over the minutes of the script is predicted in the phase it is measured;
* memory: rank 0's ``mem/activation_peak_bytes`` (rank 0 hosts experts 0..E/ep-1, the hottest under
  zipf and hot) against the plan's activation peak of the hottest rank.
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
from benchmarks.skew import MODEL, WIDE, timed_step_s, timed_windows_median  # noqa: E402

OUT = ROOT / "runs" / "skew-plan-validation"
RUNS = (("balanced", ["--moe.force_balance=round_robin"], None, "none"),
        ("zipf:1.2 dropless", ["--moe.force_skew=zipf:1.2"], None, "zipf:1.2"),
        ("hot:1:0.5 dropless", ["--moe.force_skew=hot:1:0.5"], None, "hot:1:0.5"),
        ("zipf:1.2 capacity 1.25", ["--moe.force_skew=zipf:1.2"], 1.25, "zipf:1.2"))


def _overrides(ep: int, steps: int, width: list[str]) -> list[str]:
    return [*MODEL, *width, f"--parallel.ep={ep}", f"--train.micro_batch_size={16 // ep}", f"--train.steps={steps}",
            "--log.memory=true"]


def _measure(run_dir: Path, ep: int, steps: int, extra: list[str], *, width: list[str], reuse: bool,
             repeats: int) -> dict:
    from moetrain.train.routing_trace import rank_loads

    if not (reuse and (run_dir / "metrics.jsonl").is_file()):
        shutil.rmtree(run_dir, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "moetrain.cli", "train", "--nproc", str(ep),
                        *_overrides(ep, steps, width), *extra, f"--log.run_dir={run_dir}"],
                       cwd=ROOT, check=True, capture_output=True)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    recs = [r for r in recs if "loss" in r and r["step"] > 2]
    _, _, load_SLGP = rank_loads(run_dir)
    dropped = [statistics.mean(r["dropped_fraction"]) if isinstance(r.get("dropped_fraction"), list)
               else r.get("dropped_fraction", 0.0) for r in recs]
    timing = run_dir.with_name(run_dir.name + "-timing")
    reused = reuse and (timing / "metrics.jsonl").is_file()
    step_s = timed_windows_median(timing) if reused else timed_step_s(timing, ep, [*width, *extra], repeats)
    return {"hot_copies": float(load_SLGP.amax(-1).nanmean()),  # one micro-batch per step (grad_accum 1)
            "dropped": statistics.mean(dropped), "step_s": step_s,
            "activation_peak": max(r["mem/activation_peak_bytes"] for r in recs if "mem/activation_peak_bytes" in r)}


def _calibrate(path: Path, width: list[str], procs: tuple[int, ...] = (2, 4)) -> None:
    from moetrain.config.loader import load_config, save_config

    config = path.parent / "model.yaml"
    save_config(load_config(None, _overrides(2, 8, width)), config)
    subprocess.run([sys.executable, "-m", "moetrain.plan.calibrate", "--out", str(path), "--config", str(config),
                    "--procs", *map(str, procs)], cwd=ROOT, check=True)


def _predict(ep: int, steps: int, skew: str, capacity: float | None, calibration: Path, width: list[str]):
    from moetrain.config.loader import load_config
    from moetrain.plan.skew import make_skew_plan
    from moetrain.plan.step_time import load_profile

    cfg = load_config(None, _overrides(ep, steps, width))
    profile = load_profile(str(calibration), procs_per_node=ep)
    plan = make_skew_plan(cfg, nproc=ep, skew=skew, profile=profile,
                          capacity_factors=(capacity,) if capacity else (1.25,), spare_slots=())
    return plan.rows[0], plan.rows[1 if capacity else 0]  # (dropless, the run's setting)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--calibration", default=None, help="a calibration file (default: measure one first)")
    p.add_argument("--recalibrate", action="store_true", help="calibrate each ep right before its rows")
    p.add_argument("--repeats", type=int, default=3, help="timing runs per row (the median of their medians)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", choices=("small", "wide"), default="small",
                   help="benchmarks/skew.py's model, or the same at 8x the expert work per token (--model wide)")
    p.add_argument("--reuse", action="store_true", help="read the runs already in runs/skew-plan-validation")
    a = p.parse_args()
    out = OUT.with_name(OUT.name + "-wide") if a.model == "wide" else OUT
    width = WIDE if a.model == "wide" else []
    out.mkdir(parents=True, exist_ok=True)
    calibration = Path(a.calibration) if a.calibration else out / "calibration.json"
    if a.calibration and a.recalibrate:
        raise ValueError("--calibration and --recalibrate exclude each other")
    if a.calibration is None and not a.recalibrate:
        _calibrate(calibration, width)
    rows = []
    for ep in (2, 4):
        if a.recalibrate:
            calibration = out / f"calibration-ep{ep}.json"
            if not (a.reuse and calibration.is_file()):
                _calibrate(calibration, width, (ep,))
        for name, extra, capacity, skew in RUNS:
            cap = [] if capacity is None else [f"--moe.capacity_factor={capacity}"]
            got = _measure(out / f"ep{ep}-{name.replace(':', '_').replace(' ', '-')}", ep, a.steps, extra + cap,
                           width=width, reuse=a.reuse, repeats=a.repeats)
            dropless, want = _predict(ep, a.steps, skew, capacity, calibration, width)
            row = {"ep": ep, "setting": name,
                   "hot_copies": [round(max(dropless.copies_per_rank)), round(got["hot_copies"])],
                   "dropped": [round(want.dropped_fraction, 4), round(got["dropped"], 4)],
                   "step_s": [round(want.step_s or 0.0, 4), round(got["step_s"], 4)],
                   "activation_peak_mib": [round(want.activation_bytes / 2**20, 2),
                                           round(got["activation_peak"] / 2**20, 2)]}
            rows.append(row)
            print(json.dumps(row) if a.json else row, flush=True)
    if not a.json:
        print("| ep | setting | hot rank copies, predicted / measured | dropped | step s | activation peak MiB |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            cells = [f"{x[0]} / {x[1]}" for x in (r["hot_copies"], r["dropped"], r["step_s"],
                                                   r["activation_peak_mib"])]
            print(f"| {r['ep']} | {r['setting']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
