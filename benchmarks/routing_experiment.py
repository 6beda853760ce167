"""Which load-balancing / routing strategy to use: the same model, data and budget trained once per
strategy at ep=2; the measurements go to ``docs/routing_results.json``, the plot to
``docs/routing_load.png`` and the tables to the results section of ``docs/routing.md`` (between
its BEGIN/END RESULTS markers; the hand-written text around them is never rewritten).

    python benchmarks/routing_experiment.py                       # all strategies, 200 steps each
    python benchmarks/routing_experiment.py --steps 20 --only aux_0.01,expert_choice --out /tmp/x
    python benchmarks/routing_experiment.py --render-only         # plot + section from the saved JSON

Model and data: the shipped ``tiny`` config (4 blocks of dim 128, 8 experts top-2 of hidden 256, BPE 4096
on Shakespeare, 16 x 256-token sequences per step), lr 1e-3 with 15 warmup steps and cosine decay.
Each strategy runs on 2 forked gloo processes with experts split over them (ep=2), one thread
each, with its own small training loop (Transformer, parallelize, build_optimizer,
install_balancing and the data loader), so the experiment does not depend on the trainer.

Measured per strategy: final validation loss (fixed validation batches), load CV and max/mean
load (mean over layers, over the second half of training), dropped fraction, all-to-all bytes per
step (the dispatcher's counters, summed over both ranks and all layers) and what a dispatcher that
sent each token once per destination rank would move, tokens/s, and the load CV every few steps
(for the plot).

Shape legend: B sequences per rank, S sequence length, L MoE layers, E experts.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

# name -> (moe overrides, short description). The baseline is the tiny preset's dropless softmax
# top-2; every run differs from it only in the listed fields.
STRATEGIES: dict[str, tuple[dict, str]] = {
    "no_balancing": ({"aux_loss_coef": 0.0}, "softmax top-2, no balancing at all"),
    "aux_0.01": ({"aux_loss_coef": 0.01}, "softmax top-2 + Switch load-balancing loss 0.01"),
    "aux_free_bias": ({"router": "sigmoid", "router_bias_update_rate": 1e-3, "aux_loss_coef": 0.0},
                      "sigmoid top-2, DeepSeek-V3 selection bias (rate 1e-3), no aux loss"),
    "expert_choice": ({"router": "expert_choice", "capacity_factor": 1.0},
                      "each expert takes T*K/E tokens (capacity factor 1.0)"),
    "dynamic_capacity": ({"aux_loss_coef": 0.01, "capacity_factor": 1.0, "dynamic_capacity": True,
                          "balance_interval": 10},
                         "aux 0.01, capacity factor 1 + 0.5 * sigmoid(std(load) - 1) every 10 steps (start 1.0)"),
    "two_level": ({"aux_loss_coef": 0.01, "num_expert_groups": 2, "top_groups": 1},
                  "aux 0.01, 2 groups = the 2 ep ranks, each token uses 1 group"),
    "lr_compensation": ({"aux_loss_coef": 0.01, "expert_lr_scale_max": 2.0, "balance_interval": 10},
                        "aux 0.01, under-used experts learn up to 2x faster (scales every 10 steps)"),
}


def job_config(steps: int, moe_overrides: dict):
    from moetrain.config.loader import load_config

    # The alarm counts every check above 3x balance (no warm-up, no persistence rule): the number
    # of alarms is the table's measure of how long a layer stayed collapsed.
    overrides = [f"--train.steps={steps}", "--optim.warmup_steps=15", "--log.tensorboard=false",
                 "--moe.collapse_threshold=0.75", "--moe.collapse_warmup_steps=0",
                 "--moe.collapse_consecutive_checks=1"]
    overrides += [f"--moe.{k}={v}" for k, v in moe_overrides.items()]
    return load_config("tiny", overrides)


# ----- one run, on every rank -------------------------------------------------------------------

def train_rank(rank: int, world_size: int, cfg, data, *, log_every: int, eval_batches: int) -> dict:
    """Train ``cfg`` on this rank; rank 0 returns the measurements."""
    from moetrain.distributed import (
        ParallelDims,
        clip_global_grad_norm_,
        collect_comm_stats,
        no_sync,
        parallelize,
    )
    from moetrain.models.transformer import Transformer
    from moetrain.train.balancing import install_balancing
    from moetrain.train.evaluate import evaluate_lm
    from moetrain.train.optim import build_optimizer, build_scheduler

    dims = ParallelDims.from_config(cfg.parallel, world_size=world_size, num_experts=cfg.moe.num_experts)
    dims.build_mesh("cpu")
    t, o = cfg.train, cfg.optim
    grad_accum = t.grad_accum_steps(dims.dp)
    micro_global = t.micro_batch_size * dims.dp
    train_loader = data.train_loader(global_batch_size=micro_global, dp_rank=dims.dp_rank, dp_size=dims.dp,
                                     seed=t.seed)
    val_loader = data.val_loader(global_batch_size=micro_global, dp_rank=dims.dp_rank, dp_size=dims.dp)
    model = Transformer(cfg.model.with_vocab_size(data.vocab_size), moe=cfg.moe, seed=t.seed)
    train_model = parallelize(model, dims)
    optimizer = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps)
    scheduler = build_scheduler(optimizer, lr=o.lr, min_lr=o.resolved_min_lr, warmup_steps=o.warmup_steps,
                                total_steps=t.steps, schedule=o.schedule)
    balancer = install_balancing(optimizer, model, dims)
    params = [p for p in model.parameters() if p.requires_grad]
    row_bytes = cfg.model.dim * 4  # fp32 token rows

    series, bytes_per_step, once_per_rank_bytes = [], [], []
    train_time = 0.0
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        train_model.train()
        sends = 0
        for micro in range(grad_accum):
            input_ids_BS, labels_BS = train_loader.next_batch()
            with no_sync(train_model) if micro < grad_accum - 1 else _null():
                out = train_model(input_ids_BS, labels_BS)
                (out.total_loss / grad_accum).backward()
            sends += sum(int(a.num_token_rank_sends) for a in out.moe_aux if a.num_token_rank_sends is not None)
        clip_global_grad_norm_(params, o.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0
        # Bytes the per-copy all-to-all moved (both ranks, all layers, dispatch + combine), and
        # what a once-per-destination-rank dispatch would move: each (token, remote rank) row
        # goes there and comes back.
        comm = collect_comm_stats(model)
        moved = torch.tensor([float(comm.bytes_sent), float(2 * sends * row_bytes)])
        dist.all_reduce(moved)
        bytes_per_step.append(moved[0].item())
        once_per_rank_bytes.append(moved[1].item())
        if step % log_every == 0 or step == t.steps:
            m = balancer.metrics()  # collective
            series.append({"step": step, "loss": out.loss.item(), **{k: m[k] for k in (
                "load_cv", "load_max_over_mean", "dropped_fraction", "max_token_fraction", "routing_entropy",
                "num_unused_experts", "routing_collapse_alarms")}, **(
                {"capacity_factor": m["capacity_factor"]} if "capacity_factor" in m else {})})

    train_model.eval()
    val_loss = evaluate_lm(model, val_loader.eval_batches(eval_batches * micro_global), dims=dims,
                           device=torch.device("cpu"), dtype="fp32")["val_loss"]
    if rank != 0:
        return {}
    tokens = t.steps * t.global_batch_size * cfg.data.seq_len
    return {"val_loss": val_loss, "tokens_per_s": tokens / train_time, "series": series,
            "a2a_bytes_per_step": statistics.mean(bytes_per_step),
            "once_per_rank_bytes_per_step": statistics.mean(once_per_rank_bytes) if any(once_per_rank_bytes)
            else None}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _rank_main(rank, world_size, init_file, results, cfg, data, kwargs):
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        out = train_rank(rank, world_size, cfg, data, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_strategy(cfg, data, world_size: int, **kwargs) -> dict:
    """Fork ``world_size`` gloo ranks (like tests/helpers/dist_launcher.py) and train."""
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="moetrain-routing-")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, os.path.join(tmp, "store"), results, cfg, data,
                                                  kwargs)) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        out = {}
        for _ in range(world_size):
            rank, ok, payload = results.get(timeout=3600)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for p in procs:
            p.join(timeout=30)
        return out[0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


# ----- the report ------------------------------------------------------------------------------

def summarise(res: dict) -> dict:
    """Table numbers: imbalance averaged over layers and over the second half of training (the
    first steps measure the random init more than the strategy)."""
    series = res["series"]
    late = series[len(series) // 2:]

    def mean_over(key):
        return statistics.mean(statistics.mean(s[key]) for s in late)

    return {"val_loss": res["val_loss"], "load_cv": mean_over("load_cv"),
            "final_cv": statistics.mean(series[-1]["load_cv"]),
            "max_over_mean": mean_over("load_max_over_mean"), "dropped": mean_over("dropped_fraction"),
            "a2a_mb": res["a2a_bytes_per_step"] / 1e6,
            "once_mb": (None if res["once_per_rank_bytes_per_step"] is None
                        else res["once_per_rank_bytes_per_step"] / 1e6),
            "tokens_per_s": res["tokens_per_s"],
            "unused": max(max(s["num_unused_experts"]) for s in series),
            "alarms": sum(sum(s["routing_collapse_alarms"]) for s in series)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results.items():
        steps = [s["step"] for s in res["series"]]
        axes[0].plot(steps, [statistics.mean(s["load_cv"]) for s in res["series"]], lw=1.3, label=name)
        axes[1].plot(steps, [statistics.mean(s["load_max_over_mean"]) for s in res["series"]], lw=1.3, label=name)
    axes[0].set_ylabel("load CV (std / mean of tokens per expert)")
    axes[1].set_ylabel("max / mean load (the hottest expert)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_title("Load imbalance, mean over the 4 MoE layers")
    axes[1].set_title("Hottest expert's load / mean")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    head = ("| strategy | final val loss | load CV (2nd half / last) | max/mean load | dropped | "
            "all-to-all MB/step (ep=2) | once-per-rank MB/step | tokens/s | unused experts | collapse alarms |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for name, res in results.items():
        s = summarise(res)
        once = "n/a" if s["once_mb"] is None else f"{s['once_mb']:.2f}"
        rows.append(f"| `{name}` | {s['val_loss']:.4f} | {s['load_cv']:.3f} / {s['final_cv']:.3f} | "
                    f"{s['max_over_mean']:.2f} | "
                    f"{100 * s['dropped']:.1f}% | {s['a2a_mb']:.2f} | {once} | {s['tokens_per_s']:.0f} | "
                    f"{s['unused']} | {s['alarms']} |")
    return head + "\n".join(rows) + "\n"


BEGIN = "<!-- BEGIN RESULTS"
END = "<!-- END RESULTS -->"


def results_section(run: dict) -> str:
    """The generated part of docs/routing.md: settings, results table, figure, ranking, and the
    figures the prose reads off the logged series."""
    results = run["results"]
    rows = {name: summarise(res) for name, res in results.items()}
    ranked = sorted(rows, key=lambda n: rows[n]["val_loss"])
    overrides = run.get("strategies") or {name: STRATEGIES[name][0] for name in results}
    settings = "\n".join(f"| `{name}` | {STRATEGIES[name][1]} | `{_yaml_inline(overrides[name])}` |"
                         for name in results)
    ranking = " < ".join(f"`{name}` {rows[name]['val_loss']:.3f}" for name in ranked)
    derived = {
        "first collapse alarm of `no_balancing` (last step of its log window)":
            _first_alarm_step(results.get("no_balancing")),
        "step from which `aux_free_bias` stays better balanced than `aux_0.01`":
            _catch_up_step(results.get("aux_free_bias"), results.get("aux_0.01")),
        "capacity factor of `dynamic_capacity` at the end (mean over layers)":
            _final_capacity_factor(results.get("dynamic_capacity")),
    }
    command = run.get("command") or _command(run["steps"])
    return "\n".join([
        (f"{BEGIN}: written by benchmarks/routing_experiment.py from routing_results.json "
        "(--render-only rewrites it); change the script, not this section -->"),
        "",
        f"    {command}",
        "",
        "| strategy | setting | `moe:` overrides of the tiny config |",
        "|---|---|---|",
        settings,
        "",
        table(results),
        "![load imbalance over steps](routing_load.png)",
        "",
        f"Validation loss, best first: {ranking}.",
        "",
        *(f"* {what}: {_number(value)}" for what, value in derived.items()),
        "",
        END,
    ])


def write_results_section(run: dict, doc: Path) -> None:
    """Replace the text between the markers of ``doc``; the hand-written text around them is
    never touched."""
    text = doc.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{doc} has no '{BEGIN} ...' / '{END}' pair of markers: add them where the "
                         "results belong (nothing was written)")
    doc.write_text(text[:start] + results_section(run) + text[end + len(END):])


def _command(steps: int) -> str:
    return "python benchmarks/routing_experiment.py" + (f" --steps {steps}" if steps != 200 else "")


def _number(value: float) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def _mean_cv(point: dict) -> float:
    return statistics.mean(point["load_cv"])


def _first_alarm_step(res: dict | None) -> int | float:
    """Last step of the first log window in which a collapse alarm fired."""
    for point in (res or {}).get("series", []):
        if sum(point["routing_collapse_alarms"]) > 0:
            return point["step"]
    return math.nan


def _catch_up_step(slow: dict | None, ref: dict | None) -> int | float:
    """First logged step from which ``slow``'s layer-mean CV stays at or below ``ref``'s."""
    if not slow or not ref:
        return math.nan
    pairs = list(zip(slow["series"], ref["series"], strict=False))
    for i, (a, _) in enumerate(pairs):
        if all(_mean_cv(x) <= _mean_cv(y) for x, y in pairs[i:]):
            return a["step"]
    return math.nan


def _final_capacity_factor(res: dict | None) -> float:
    if not res or "capacity_factor" not in res["series"][-1]:
        return math.nan
    return statistics.mean(res["series"][-1]["capacity_factor"])


def _yaml_inline(overrides: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in overrides.items())




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--only", default=None, help="comma-separated strategy names (default: all)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "docs",
                   help="where routing_results.json and routing_load.png go; the results section of "
                        "OUT/routing.md is rewritten when that file exists and every strategy ran")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite the plot and the results section of OUT/routing.md from "
                        "OUT/routing_results.json, without training")
    args = p.parse_args()
    doc = args.out / "routing.md"
    if args.render_only:
        run = json.loads((args.out / "routing_results.json").read_text())
        plot(run["results"], args.out / "routing_load.png")
        write_results_section(run, doc)
        print(f"wrote {args.out / 'routing_load.png'} and the results section of {doc}")
        return
    from moetrain.data import prepare_data

    names = list(STRATEGIES) if args.only is None else args.only.split(",")
    base = job_config(args.steps, {})
    data = prepare_data(base.data)  # cached after the first run; the forked ranks share it
    results, started = {}, time.time()
    for name in names:
        t0 = time.time()
        cfg = job_config(args.steps, STRATEGIES[name][0])
        results[name] = run_strategy(cfg, data, 2, log_every=args.log_every, eval_batches=args.eval_batches)
        print(f"{name}: val loss {results[name]['val_loss']:.4f}, {time.time() - t0:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    run = {"steps": args.steps, "command": _command(args.steps), "strategies": {n: STRATEGIES[n][0] for n in names},
           "results": results}
    (args.out / "routing_results.json").write_text(json.dumps(run, indent=1))
    plot(results, args.out / "routing_load.png")
    print(table(results))
    complete = set(names) == set(STRATEGIES) and doc.exists()
    if complete:
        write_results_section(run, doc)
    print(f"total {time.time() - started:.0f} s; wrote {args.out}/routing_results.json, routing_load.png"
          + (f" and the results section of {doc}: re-read its hand-written analysis against the new table"
             if complete else ""))


if __name__ == "__main__":
    main()
