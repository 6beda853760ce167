"""Predicted vs measured step time of the demo model (``moetrain demo``'s config) at world 1, 2, 4.

    .venv/bin/python -m moetrain.plan.calibrate --out runs/calibration.json     # once, on an idle machine
    .venv/bin/python benchmarks/step_time_validation.py --calibration runs/calibration.json

Each layout trains the demo's job (``--config tiny``: 4 blocks of dim 128, 8 experts top-2, 16
sequences of 256 tokens per step, fp32) for ``--steps`` steps under ``moetrain train --nproc N``
(torchrun, ``OMP_NUM_THREADS`` = cores // N as the launcher sets it), without evaluation,
checkpoints or memory tracking, logging every ``--window`` steps. The measured step time is the
median over the windows after the first ``--warmup`` steps of ``step_time_s`` in the run's
metrics.jsonl (the trainer's own clock: wall time of the window / steps). The prediction is
``moetrain.plan.step_time.estimate_step_time`` with the calibrated "cpu" profile, for the same
layout and the threads that layout's ranks get. Prints a markdown table (docs/step-time.md).

``--only LABEL`` (repeatable) re-measures single rows; ``--predict-only`` skips the runs;
``--recalibrate`` measures the row's process count again right before the row and predicts with
that (for a machine whose other work comes and goes between a one-off calibration and the row).
Other work on the same cores slows the measurement, not the prediction: run it when ``uptime``
shows a load average well below 1 and quote the medians of repeated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetrain.config.loader import load_config
from moetrain.plan.calibrate import measure as measure_machine
from moetrain.plan.calibrate import profile_from_measurement
from moetrain.plan.step_time import CalibratedProfiles, DeviceProfile, estimate_for_config

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    label: str
    world: int
    overrides: tuple[str, ...] = ()


CASES = (
    Case("world 1", 1, ("--parallel.ep=1",)),
    Case("dp 2", 2, ("--parallel.ep=1",)),
    Case("ep 2 (the demo)", 2, ("--parallel.ep=2",)),
    Case("ep 2 + zero 2", 2, ("--parallel.ep=2", "--parallel.zero_stage=2")),
    Case("ep 2 + full AC", 2, ("--parallel.ep=2", "--train.activation_checkpointing=full")),
    # 16 sequences over 4 ranks: micro-batches of 4 (what the planner plans, and the trainer requires).
    Case("dp 4", 4, ("--parallel.ep=1", "--train.micro_batch_size=4")),
    Case("ep 4", 4, ("--parallel.ep=4", "--train.micro_batch_size=4")),
    Case("ep 2 x dp 2", 4, ("--parallel.ep=2", "--train.micro_batch_size=4")),
)

COMMON = ("--train.eval_every=0", "--checkpoint.every=0", "--checkpoint.save_final=false", "--log.memory=false",
          "--log.progress_bar=false")


def measure(case: Case, *, steps: int, window: int, warmup: int) -> list[float]:
    """Per-window step times (seconds) of one training run of ``case``, after ``warmup`` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "moetrain.cli", "train", "--config", "tiny", "--nproc", str(case.world),
               f"--train.steps={steps}", f"--log.every={window}", f"--log.run_dir={run_dir}",
               "--sample-tokens=0", *COMMON, *case.overrides]
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{case.label}: exit {done.returncode}\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] - window >= warmup]


def predict(case: Case, profile: DeviceProfile):
    cfg = load_config("tiny", [*COMMON, *case.overrides])
    return estimate_for_config(cfg, world=case.world, profile=profile)


def calibration_table(profiles) -> str:
    """The calibrated "cpu" profiles, one row per process count."""
    header = ("| processes x threads | peak GFLOP/s | dense GEMM | expert GEMM | attention | elementwise GB/s | "
              "optimizer GB/s | all-reduce GB/s, ms | all-to-all GB/s, ms | all-gather GB/s, ms | "
              "reduce-scatter GB/s, ms | overlap | us per operation |")
    lines = [header, "|---" * 13 + "|"]
    for n, p in sorted(profiles.by_procs.items()):
        peak = p.peak("fp32")
        coll = p.intra_node.by_collective or {}
        links = [f"{coll[c][0] / 1e9:.2f}, {coll[c][1] * 1e3:.2f}" if c in coll else "-"
                 for c in ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")]
        overlap = f"{p.comm_overlap:.2f}" if n > 1 else "-"
        lines.append(f"| {n} x {p.threads_per_rank:g} | {peak / 1e9:.1f} | {p.gemm_efficiency * peak / 1e9:.1f} | "
                     f"{p.expert_gemm_efficiency * peak / 1e9:.1f} | {p.attention_efficiency * peak / 1e9:.1f} | "
                     f"{p.memory_bandwidth / 1e9:.2f} | {p.optimizer_bandwidth / 1e9:.2f} | {' | '.join(links)} | "
                     f"{overlap} | {p.op_overhead_s * 1e6:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", required=True, help="JSON written by python -m moetrain.plan.calibrate")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the row's process count again just before each row (a machine shared with "
                        "other work changes speed between a one-off calibration and the row)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--window", type=int, default=5, help="steps per logged window")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    p.add_argument("--only", action="append", default=None, help="measure only the rows with this label")
    p.add_argument("--predict-only", action="store_true")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    profile = DeviceProfile.from_json(args.calibration)
    cases = [c for c in CASES if args.only is None or c.label in args.only]
    rows = []
    print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for case in cases:
        if args.recalibrate:
            fresh = profile_from_measurement(measure_machine(case.world))
            profile = CalibratedProfiles({**profile.by_procs, case.world: DeviceProfile.from_dict(fresh)})
        est = predict(case, profile)
        measured = None
        if not args.predict_only:
            t0 = time.perf_counter()
            windows = measure(case, steps=args.steps, window=args.window, warmup=args.warmup)
            measured = statistics.median(windows)
            print(f"{case.label}: windows {[round(w, 3) for w in windows]} ({time.perf_counter() - t0:.0f} s, "
                  f"load {os.getloadavg()[0]:.2f})", file=sys.stderr)
        rows.append((case, est, measured))
    print(calibration_table(profile))
    print()
    print("| layout | world | threads/rank | predicted s/step | measured s/step (median) | error | "
          "compute | exposed comm | fixed | of which host |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, est, measured in rows:
        err = "-" if measured is None else f"{(est.step_s - measured) / measured:+.1%}"
        meas = "-" if measured is None else f"{measured:.3f}"
        print(f"| {case.label} | {case.world} | {est.threads_per_rank:g} | {est.step_s:.3f} | {meas} | {err} | "
              f"{est.compute_s:.3f} | {est.exposed_comm_s:.3f} | {est.fixed_s:.3f} | {est.host_s:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"layout": c.label, "world": c.world, "predicted_s": e.step_s, "measured_s": m,
              "breakdown": e.as_dict()} for c, e, m in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
