"""MoE vs dense models: at equal active parameters (the demo), and against dense models 1x-4x its size.

    python benchmarks/moe_vs_dense.py            # trains the shipped configs tiny and tiny-dense (2 procs each)
    python benchmarks/moe_vs_dense.py --no-train # only tabulate runs/tiny and runs/tiny-dense
    python benchmarks/moe_vs_dense.py --sizes    # dense 1x/2x/4x vs MoE 8/32 experts on the sotu corpus
    python benchmarks/moe_vs_dense.py --sizes --no-train   # only tabulate and plot runs/sizes/*

The default prints a Markdown table: final val loss / perplexity and the median tokens/s over the
logged steps.

``--sizes`` trains five models, each in one single-threaded process, two at a time, on the same tokens
of the ``sotu`` corpus (State of the Union addresses, 3.3M training tokens at BPE 2048): dense models
with 1x, 2x and 4x the non-embedding active parameters of the MoE, and the MoE with 8 and with 32
experts (top-2, expert hidden 2 x dim, so both have the 1x dense model's active parameters plus a
router). No model sees a training window twice: the steps are checked against one epoch of the
training split. It prints each model's final validation loss, the dense size each MoE matches
(log-interpolated in non-embedding parameters between the two dense points around its loss), and draws
the validation curves into docs/moe_vs_dense.png. Non-embedding parameters, as in the scaling-law
literature: at dim 64 the tied 2048-entry embedding is 40% of the 1x model and would blur the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"MoE (tiny: 8 experts, top-2)": ("tiny", "runs/tiny"),
        "dense (tiny-dense: FFN 512)": ("tiny-dense", "runs/tiny-dense")}
"""Table row -> (shipped config name, run folder under the repository root)."""


@dataclass(frozen=True)
class Size:
    """One model of the ``--sizes`` comparison: 4 blocks, 4 heads, GELU FFNs of hidden 4 x dim."""

    name: str
    dim: int
    num_experts: int = 0
    """0 = dense; otherwise top-2 MoE in every block with experts of hidden 2 x dim (active FFN 4 x dim)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def overrides(self) -> list[str]:
        if self.is_moe:
            return ["--config", "tiny", f"--model.dim={self.dim}", f"--moe.num_experts={self.num_experts}",
                    f"--moe.expert_hidden_dim={2 * self.dim}"]
        return ["--config", "tiny-dense", f"--model.dim={self.dim}", f"--model.dense_hidden_dim={4 * self.dim}"]


# Non-embedding parameters grow as ~12 dim^2 per block: dim 88 gives 1.89x and dim 128 4.0x of dim 64
# (88, not 90 = 64 sqrt 2, keeps the head dim even for the rotary embedding).
SIZES = (Size("dense 1x", 64), Size("dense 2x", 88), Size("dense 4x", 128),
         Size("MoE 8 experts", 64, num_experts=8), Size("MoE 32 experts", 64, num_experts=32))
SIZES_DIR = "runs/sizes"
CORPUS, VOCAB, SEQ_LEN, BATCH = "sotu", 2048, 128, 16
"""A small vocabulary: at dim 64 a 4096-entry output layer would cost more than the four blocks."""


def _params(run_dir: Path):
    from moetrain.config.loader import config_from_dict
    from moetrain.models.transformer import count_params

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    return count_params(cfg.model, cfg.moe, vocab_size=vocab)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def _train_command(args: list[str], run_dir: str, nproc: int) -> list[str]:
    return [sys.executable, "-m", "moetrain.cli", "train", *args, "--nproc", str(nproc), "--log.progress_bar=false",
            f"--log.run_dir={run_dir}"]


def _train(args: list[str], run_dir: str, nproc: int) -> None:
    subprocess.run(_train_command(args, run_dir, nproc), cwd=ROOT, check=True)


def _train_all(jobs: dict[str, tuple[list[str], str]], *, parallel: int, threads: int) -> dict[str, float]:
    """Single-process runs, ``parallel`` at a time with ``threads`` threads each (each run's output in
    ``<run_dir>.log``); returns each run's wall time in seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    pending, running, seconds = list(jobs.items()), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, (args, run_dir) = pending.pop(0)
            log = open(ROOT / f"{run_dir}.log", "w")  # noqa: SIM115 - closed when the run ends
            proc = subprocess.Popen(_train_command(args, run_dir, 1), cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
            running[name] = (proc, log, time.perf_counter())
        time.sleep(1.0)
        for name, (proc, log, start) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            if proc.returncode != 0:
                raise SystemExit(f"{name}: training failed (exit {proc.returncode}), see {log.name}")
            seconds[name] = time.perf_counter() - start
            print(f"{name}: {seconds[name] / 60:.1f} min", flush=True)
    return seconds


def matched_dense_params(loss: float, dense: list[tuple[float, float]]) -> tuple[float, bool]:
    """Dense parameter count whose validation loss would be ``loss``: log-linear interpolation between
    the two dense points (params, loss) around it, sorted by params; outside their range the nearest
    segment is extended and the second value is True (extrapolated)."""
    points = sorted(dense)
    assert len(points) >= 2, "two dense points are needed to interpolate"
    segment = 0
    while segment < len(points) - 2 and loss < points[segment + 1][1]:
        segment += 1
    (p0, l0), (p1, l1) = points[segment], points[segment + 1]
    if l0 == l1:
        raise ValueError(f"dense losses {l0} at {p0} and {p1} parameters are equal: no slope to interpolate")
    t = (loss - l0) / (l1 - l0)
    outside = loss > points[0][1] or loss < points[-1][1]
    return math.exp(math.log(p0) + t * (math.log(p1) - math.log(p0))), outside


def _check_no_repetition(steps: int) -> tuple[int, int]:
    """Prepare the corpus (cached) and refuse a budget that would revisit a training window."""
    from moetrain.config.data import DataConfig
    from moetrain.data.prepare import prepare_data

    data = prepare_data(DataConfig(corpus=CORPUS, vocab_size=VOCAB, seq_len=SEQ_LEN))
    steps_per_epoch = len(data.train_tokens) // SEQ_LEN // BATCH
    if steps > steps_per_epoch:
        raise SystemExit(f"--steps {steps} would repeat data: one epoch of {CORPUS} is {steps_per_epoch} steps")
    return len(data.train_tokens), len(data.val_tokens)


def _size_args(size: Size, *, steps: int, eval_every: int, num_val_batches: int) -> list[str]:
    return [*size.overrides(), f"--data.corpus={CORPUS}", f"--data.vocab_size={VOCAB}", f"--data.seq_len={SEQ_LEN}",
            "--parallel.ep=1", f"--train.steps={steps}", f"--train.global_batch_size={BATCH}",
            f"--train.micro_batch_size={BATCH}", f"--train.eval_every={eval_every}",
            f"--train.eval_steps={num_val_batches}", f"--optim.warmup_steps={max(steps // 20, 1)}",
            "--checkpoint.every=0", "--checkpoint.save_final=false", "--log.tensorboard=false"]


def run_sizes(a: argparse.Namespace) -> None:
    train_tokens, val_tokens = _check_no_repetition(a.steps)
    num_val_batches = val_tokens // SEQ_LEN // BATCH  # at most the whole validation split, in order
    num_val_batches = min(num_val_batches, a.val_batches)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    if not a.no_train:
        (ROOT / SIZES_DIR).mkdir(parents=True, exist_ok=True)
        jobs = {size.name: (_size_args(size, steps=a.steps, eval_every=a.eval_every, num_val_batches=num_val_batches),
                            f"{SIZES_DIR}/{_slug(size.name)}") for size in SIZES}
        seconds = _train_all(jobs, parallel=a.parallel, threads=a.threads)
    rows = {size.name: _size_row(size) for size in SIZES}
    steps = {r["curve"][-1][0] // (BATCH * SEQ_LEN) for r in rows.values()}
    assert len(steps) == 1, f"the runs under {SIZES_DIR} stopped at different steps: {sorted(steps)}"
    _print_sizes(rows, seconds, steps=steps.pop(), train_tokens=train_tokens,
                 val_tokens=num_val_batches * BATCH * SEQ_LEN)
    if seconds:
        print(f"total wall time: {(time.perf_counter() - start) / 60:.1f} min ({a.parallel} run(s) at a time, "
              f"OMP_NUM_THREADS={a.threads})")
    _plot(rows, ROOT / a.plot)
    print(f"\nplot: {a.plot}")


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-")


def _size_params(size: Size):
    """Parameter counts of ``size`` from its command line (not the run's saved config, which may hold
    fields of another version of moetrain)."""
    from moetrain.config.loader import load_config
    from moetrain.models.transformer import count_params

    _, config, *overrides = size.overrides()
    cfg = load_config(config, [*overrides, f"--data.vocab_size={VOCAB}"])
    return count_params(cfg.model, cfg.moe, vocab_size=VOCAB)


def _size_row(size: Size) -> dict:
    run_dir = ROOT / SIZES_DIR / _slug(size.name)
    pc = _size_params(size)
    recs = _records(run_dir)
    curve = [(r["step"] * BATCH * SEQ_LEN, r["val_loss"]) for r in recs if "val_loss" in r]
    return {"size": size, "active": pc.active - pc.embedding, "total": pc.total - pc.embedding, "curve": curve,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs if "tokens_per_s" in r)}


def _print_sizes(rows: dict, seconds: dict, *, steps: int, train_tokens: int, val_tokens: int) -> None:
    tokens = steps * BATCH * SEQ_LEN
    print(f"\n{steps} steps x {BATCH} x {SEQ_LEN} = {tokens / 1e6:.2f}M training tokens per model "
          f"({tokens / train_tokens:.0%} of the {train_tokens / 1e6:.2f}M in {CORPUS}'s training split: "
          f"{'no repetition' if tokens <= train_tokens else 'REPEATED'});\n"
          f"val loss over the first {val_tokens:,} validation tokens.\n")
    base = rows["dense 1x"]["active"]
    dense = [(r["active"], r["curve"][-1][1]) for r in rows.values() if not r["size"].is_moe]
    print("| model | non-embedding params (total / active) | active / dense 1x | val loss | matched dense size "
          "| tokens/s (median) | wall time |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        loss = r["curve"][-1][1]
        matched = "-"
        if r["size"].is_moe:
            params, outside = matched_dense_params(loss, dense)
            matched = f"{params / 1e6:.2f}M = {params / base:.2f}x dense 1x" + (" (extrapolated)" if outside else "")
        wall = f"{seconds[name] / 60:.1f} min" if name in seconds else "-"
        print(f"| {name} | {r['total'] / 1e6:.2f}M / {r['active'] / 1e6:.2f}M | {r['active'] / base:.2f}x "
              f"| {loss:.3f} | {matched} | {r['tokens_per_s']:,.0f} | {wall} |")


def _plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in rows.items():
        tokens, losses = zip(*r["curve"], strict=True)
        ax.plot([t / 1e6 for t in tokens], losses, marker="o", markersize=3,
                linestyle="--" if r["size"].is_moe else "-",
                label=f"{name} ({r['active'] / 1e6:.2f}M active, {r['total'] / 1e6:.2f}M total)")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"MoE vs dense on {CORPUS} (non-embedding parameters)")
    low = min(loss for r in rows.values() for _, loss in r["curve"])
    ax.set_ylim(low - 0.1, low + 1.5)  # the first evaluations are far above; the end is what matters
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(a: argparse.Namespace) -> None:
    rows = []
    for name, (config, run_dir) in RUNS.items():
        if not a.no_train:
            _train(["--config", config], run_dir, a.nproc)
        recs = _records(ROOT / run_dir)
        val = [r for r in recs if "val_loss" in r][-1]
        tps = statistics.median(r["tokens_per_s"] for r in recs)
        pc = _params(ROOT / run_dir)
        rows.append((name, pc.total / 1e6, pc.active / 1e6, val["step"], val["val_loss"], val["val_ppl"], tps))
    print("| model | params (total / active per token) | steps | val loss | val perplexity | tokens/s (median) |")
    print("|---|---|---|---|---|---|")
    for name, total, active, step, vl, ppl, tps in rows:
        print(f"| {name} | {total:.2f}M / {active:.2f}M | {step} | {vl:.3f} | {ppl:.1f} | {tps:,.0f} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--nproc", type=int, default=2, help="processes per run of the default comparison")
    p.add_argument("--sizes", action="store_true", help="dense 1x/2x/4x vs MoE 8/32 experts on the sotu corpus")
    p.add_argument("--steps", type=int, default=400, help="--sizes: steps of 16 x 128 tokens per model")
    p.add_argument("--eval-every", type=int, default=50, help="--sizes: steps between validation points")
    p.add_argument("--val-batches", type=int, default=16, help="--sizes: validation batches of 16 x 128 tokens")
    p.add_argument("--parallel", type=int, default=2, help="--sizes: runs at a time (one process each)")
    p.add_argument("--threads", type=int, default=1, help="--sizes: OMP_NUM_THREADS of each run")
    p.add_argument("--plot", default="docs/moe_vs_dense.png", help="--sizes: where the loss curves go")
    a = p.parse_args()
    run_sizes(a) if a.sizes else run_demo(a)


if __name__ == "__main__":
    main()
