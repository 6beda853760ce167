"""Which load-balancing / routing strategy to use: the same model, data and budget trained once per
strategy at ep=2, then ``docs/routing.md`` (table + plot) written from the measurements.

    python benchmarks/routing_experiment.py                       # all strategies, 200 steps each
    python benchmarks/routing_experiment.py --steps 20 --only aux_0.01,expert_choice --out /tmp/x

Model and data: configs/tiny.yaml (4 blocks of dim 128, 8 experts top-2 of hidden 256, BPE 4096
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
                         "aux 0.01, capacity factor from the seeds' formula every 10 steps (start 1.0)"),
    "two_level": ({"aux_loss_coef": 0.01, "num_expert_groups": 2, "top_groups": 1},
                  "aux 0.01, 2 groups = the 2 ep ranks, each token uses 1 group"),
    "lr_compensation": ({"aux_loss_coef": 0.01, "expert_lr_scale_max": 2.0, "balance_interval": 10},
                        "aux 0.01, under-used experts learn up to 2x faster (scales every 10 steps)"),
}


def job_config(steps: int, moe_overrides: dict):
    from moetrain.config.loader import load_config

    overrides = [f"--train.steps={steps}", "--optim.warmup_steps=15", "--log.tensorboard=false",
                 "--moe.collapse_threshold=0.75"]
    overrides += [f"--moe.{k}={v}" for k, v in moe_overrides.items()]
    return load_config(ROOT / "configs" / "tiny.yaml", overrides)


# ----- one run, on every rank -------------------------------------------------------------------

def train_rank(rank: int, world_size: int, cfg, data, *, log_every: int, eval_batches: int) -> dict:
    """Train ``cfg`` on this rank; rank 0 returns the measurements."""
    from moetrain.distributed import ParallelDims, collect_comm_stats, no_sync, parallelize
    from moetrain.models.transformer import Transformer
    from moetrain.train.balancing import install_balancing
    from moetrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm_

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
        clip_grad_norm_(params, o.grad_clip)
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
    total = torch.zeros(())
    with torch.no_grad():
        n = 0
        for input_ids_BS, labels_BS in val_loader.epoch_batches(eval_batches):
            total += model(input_ids_BS, labels_BS).loss.float()
            n += 1
    total /= n
    dist.all_reduce(total)
    val_loss = total.item() / world_size
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
    """Fork ``world_size`` gloo ranks (like tests/distributed/dist_launcher.py) and train."""
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
            "once_mb": None if res["once_per_rank_bytes_per_step"] is None else res["once_per_rank_bytes_per_step"] / 1e6,
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


def render_doc(run: dict, out: Path, *, command: str) -> Path:
    """docs/routing.md from the saved measurements (``routing_results.json``)."""
    results = run["results"]
    rows = {name: summarise(res) for name, res in results.items()}
    best_loss = min(rows, key=lambda n: rows[n]["val_loss"])
    ranked = sorted(rows, key=lambda n: rows[n]["val_loss"])
    describe = "\n".join(f"| `{name}` | {STRATEGIES[name][1]} | `{_yaml_inline(STRATEGIES[name][0])}` |"
                          for name in results)
    facts = {name: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for name, r in rows.items()}
    text = DOC.format(command=command, steps=run["steps"], table=table(results), describe=describe,
                      ranking=" < ".join(f"`{n}` {rows[n]['val_loss']:.3f}" for n in ranked), best_loss=best_loss,
                      first_alarm=_first_alarm_step(results.get("no_balancing")),
                      bias_catches_up=_catch_up_step(results.get("aux_free_bias"), results.get("aux_0.01")),
                      dyn_factor=_final_capacity_factor(results.get("dynamic_capacity")),
                      tps_min=min(r["tokens_per_s"] for r in rows.values()),
                      tps_max=max(r["tokens_per_s"] for r in rows.values()),
                      **_doc_numbers(facts))
    path = out / "routing.md"
    path.write_text(text)
    return path


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
    pairs = list(zip(slow["series"], ref["series"]))
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


def _doc_numbers(f: dict) -> dict:
    """Named numbers the prose quotes (absent strategies read as nan)."""
    def get(name, key):
        return f.get(name, {}).get(key, math.nan)

    return {
        "none_unused": get("no_balancing", "unused"), "none_final_cv": get("no_balancing", "final_cv"),
        "aux_final_cv": get("aux_0.01", "final_cv"), "bias_final_cv": get("aux_free_bias", "final_cv"),
        "bias_alarms": get("aux_free_bias", "alarms"),
        "none_cv": get("no_balancing", "load_cv"), "none_mm": get("no_balancing", "max_over_mean"),
        "none_alarms": get("no_balancing", "alarms"), "none_loss": get("no_balancing", "val_loss"),
        "aux_cv": get("aux_0.01", "load_cv"), "aux_mm": get("aux_0.01", "max_over_mean"),
        "aux_loss": get("aux_0.01", "val_loss"),
        "bias_cv": get("aux_free_bias", "load_cv"), "bias_mm": get("aux_free_bias", "max_over_mean"),
        "bias_loss": get("aux_free_bias", "val_loss"),
        "ec_loss": get("expert_choice", "val_loss"), "ec_dropped": 100 * get("expert_choice", "dropped"),
        "ec_a2a": get("expert_choice", "a2a_mb"),
        "dyn_loss": get("dynamic_capacity", "val_loss"), "dyn_dropped": 100 * get("dynamic_capacity", "dropped"),
        "dyn_a2a": get("dynamic_capacity", "a2a_mb"),
        "two_loss": get("two_level", "val_loss"), "two_a2a": get("two_level", "a2a_mb"),
        "two_once": get("two_level", "once_mb"), "aux_a2a": get("aux_0.01", "a2a_mb"),
        "aux_once": get("aux_0.01", "once_mb"),
        "lr_loss": get("lr_compensation", "val_loss"), "lr_cv": get("lr_compensation", "load_cv"),
        "ec_extra_a2a": get("expert_choice", "a2a_mb") - get("aux_0.01", "a2a_mb"),
        "dyn_minus_aux": get("dynamic_capacity", "val_loss") - get("aux_0.01", "val_loss"),
        "two_minus_aux": get("two_level", "val_loss") - get("aux_0.01", "val_loss"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--only", default=None, help="comma-separated strategy names (default: all)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="where routing.md and the plot go")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite routing.md and the plot from OUT/routing_results.json, without training")
    args = p.parse_args()
    command = "python benchmarks/routing_experiment.py" + (f" --steps {args.steps}" if args.steps != 200 else "")
    if args.render_only:
        run = json.loads((args.out / "routing_results.json").read_text())
        plot(run["results"], args.out / "routing_load.png")
        print(f"wrote {render_doc(run, args.out, command=run.get('command', command))}")
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
    run = {"steps": args.steps, "command": command, "strategies": {n: STRATEGIES[n][0] for n in names},
           "results": results}
    (args.out / "routing_results.json").write_text(json.dumps(run, indent=1))
    plot(results, args.out / "routing_load.png")
    print(table(results))
    if set(names) == set(STRATEGIES):
        render_doc(run, args.out, command=command)
    print(f"total {time.time() - started:.0f} s; wrote {args.out}/routing_results.json, routing_load.png"
          + (", routing.md" if set(names) == set(STRATEGIES) else ""))



DOC = """# Routing and load balancing

<!-- Generated by benchmarks/routing_experiment.py from docs/routing_results.json: edit the script, then
     `python benchmarks/routing_experiment.py --render-only` (or rerun the experiment). -->

Every strategy below is a field of the `moe:` config section. All of them run under expert and data
parallelism and gradient accumulation and give, on N ranks, the numbers of one process holding the
global batch: outputs, losses, every gradient, the parameters after several AdamW steps and, after every
step, the balancing state on every rank (`tests/distributed/test_routing_ep.py`, ep=2 and dp=2 x ep=2;
`tests/distributed/test_routing_zero.py`, ZeRO stages 1-3). Each router is also checked against a naive
per-token reference and hand-worked cases (`tests/unit/test_routing_*.py`).

## What there is

| `moe:` field(s) | what it does |
|---|---|
| `router: softmax` (default) | token choice: softmax over the E experts, each token takes its top_k; weights renormalised over the k (`renormalize`). Bit-for-bit the router of earlier versions. |
| `router_jitter`, `router_noise_std` | training-only perturbation of any router: input x U(1-eps, 1+eps) (Switch) and Gaussian logit noise (noisy top-k). Off by default; random per rank, so a run with noise is not layout-invariant. |
| `router: sigmoid`, `router_bias_update_rate` | DeepSeek-V3: independent sigmoid scores; a per-expert bias (buffer `router.expert_bias`) is added to the scores that *select* experts, the gate weights stay the unbiased scores. After the step's backward the bias moves by `rate * sign(mean load - load_e)` (centred). The bias also works with `router: softmax`. |
| `router: expert_choice`, `capacity_factor` | each expert takes its ceil(f * T * K / E) best tokens by softmax score: perfectly balanced, a token gets 0..E experts; skipped tokens ride the residual. |
| `num_expert_groups`, `top_groups` | two-level routing: the experts form groups of consecutive ids, a token picks its `top_groups` best groups (score: sum of the group's two best selection scores, DeepSeek-V3), then its top_k inside them. Works with softmax, sigmoid and the bias. |
| `num_shared_experts` | always-on experts added to the output of any router. |
| `aux_loss_coef`, `aux_loss_type: batch / sequence` | Switch/GShard loss `E * sum_e f_e P_e` over the global batch, or DeepSeek-V3's per-sequence version averaged over sequences. |
| `dynamic_capacity`, `dynamic_capacity_{{base,scale,shift}}`, `balance_interval` | the seeds' factor `1.0 + 0.5 * sigmoid(std(load) - 1.0)` recomputed every `balance_interval` steps from the load of that interval (load_e = tokens of e / mean, so std(load) is about the CV; torch.std is unbiased). `install_balancing(..., capacity_fn=f)` replaces the formula. |
| `expert_lr_scale_max` | per-expert learning rate: `min(max, max(1, mean load / load_e))` times the base rate, from the load of the last interval. |
| `collapse_threshold`, `collapse_aux_increase`, `collapse_aux_max`, `unused_expert_steps` | the health monitor: alarm when one expert is chosen by more than the threshold fraction of a layer's tokens over an interval (optionally raising that layer's aux coefficient), unused-expert report. |

Wiring (the trainer does this; any other loop can too):

```python
train_model = parallelize(model, dims, ...)
optimizer = wrap_optimizer(build_optimizer(model, ...), dims, zero_stage=...)
balancer = install_balancing(optimizer, model, dims)      # optimizer pre-/post-step hooks
...                                                       # forward/backward/step as usual
metrics.update(balancer.metrics())                        # at log steps, on every rank
```

## How each behaves under expert parallelism and gradient accumulation

* **Routing counts.** Each MoE layer sums its routed counts over the data-parallel group (all ranks,
  expert-parallel ones included) in every forward (the all-reduce the batch-level aux loss already
  needed), and adds them to a per-step buffer over the micro-batches of the step. A forward that
  activation checkpointing recomputes inside backward, and eval forwards, are not counted. So
  everything decided from counts is identical on every rank and independent of how the global batch
  is split into ranks and micro-batches.
* **Bias update** in the optimizer *pre-step* hook: it runs once per optimizer step, after every
  micro-batch's backward, so gradient accumulation changes nothing (tested: 1 vs 4 micro-batches give
  the same bias bit for bit; ep=2 with 2 micro-batches and activation checkpointing equals one process).
  The bias is a persistent fp32 buffer: saved in checkpoints, not broadcast, identical on every rank by
  construction. A step skipped for a non-finite loss should call `balancer.discard_step()`.
* **Expert choice under EP** uses the all-to-all dispatcher's global-batch capacity semantics: each
  expert's capacity is over the global batch of all data-parallel ranks, and the tokens it keeps are
  exactly those one process with the global batch would keep (score order, ties to the earlier global
  position). That needs each rank's (expert, score) pairs: an all-gather of T x E x 12 bytes per layer
  and rank (96 bytes per token at E=8, against 512 for one fp32 token row at D=128), plus sorting
  T x E candidates. Expert choice
  looks at the whole batch, later tokens included: right for training, not for causal decoding.
* **Dynamic capacity** is computed on every rank from the same all-reduced counts, so every rank uses
  the same factor; the all-to-all dispatcher is given it before each forward and cuts over the global
  batch as one process would. The factor is a persistent buffer (`capacity_factor_now`).
* **Two-level routing and all-to-all traffic.** With `num_expert_groups = parallel.ep` each group is one
  rank's experts, so `top_groups: 1` puts all k copies of a token on one rank. The present all-to-all
  sends one row *per copy*, so that alone does not reduce its bytes (a copy is remote with the same
  probability as before); what it reduces is the number of distinct (token, remote rank) pairs, i.e. the
  rows a dispatcher that sent each token once per destination rank (and fanned it out to the k experts
  there, as DeepSeek-V3's node-limited dispatch does) would move. The table reports both: the bytes
  the current dispatcher moved, and the once-per-rank bytes computed from the routing
  (`MoEAux.num_token_rank_sends`).

## Per-expert learning rates: why not parameter groups

The seeds put `lr: base_lr * utilization_weights` in an optimizer parameter group. Our experts are
stacked `[E, D, F]` tensors (one grouped matmul, one DTensor shard per rank under EP), and a parameter
group holds whole tensors, so a per-expert rate would need one parameter per expert: E small matmuls
instead of one grouped one, and a different checkpoint layout. Scaling the *gradient* per expert instead
does nothing for Adam: Adam divides by the running gradient magnitude, so a constant factor cancels.

So the rate is applied to the *update*: the post-step hook sets `w = w_before + s_e * (w - w_before)` for
the rows of expert e (`scale_expert_updates`). AdamW's step, `-lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)`,
is linear in lr and its moments do not depend on lr, so this is exactly AdamW with learning rate
`s_e * lr` for expert e, weight decay included; `test_expert_lr_scale_equals_adamw_with_one_learning_rate_per_expert`
checks it against torch's AdamW with one parameter group per expert. Cost: a copy of the scaled experts'
local weights during the step (skipped while all scales are 1). It works wherever the optimizer steps
expert rows it can locate: EP shards and FSDP2 (ZeRO-2/3) shards through their DTensor offsets, and
ZeRO-1's element slices (also when offloaded to the host) by hooking the inner optimizer that steps them;
`tests/distributed/test_routing_zero.py` checks all of them against one process.

## Expert-health monitoring

`balancer.metrics()` returns, per MoE layer, over the steps since the last call: `expert_share` (share
of routed copies per expert), `load_cv` (std / mean of tokens per expert), `load_max_over_mean`,
`max_token_fraction` (the largest fraction of the layer's tokens that chose one expert; k/E when
balanced), `routing_entropy` (mean nats per token of the router's normalised scores; ln E = undecided),
`load_entropy` (entropy of the shares / ln E; 1 = even), `dropped_fraction` (dropped copies, or for
expert choice skipped tokens), `unused_experts` / `num_unused_experts` (no token for
`unused_expert_steps` consecutive steps), `routing_collapse_alarms`, and when enabled `expert_bias`,
`capacity_factor`, `expert_lr_scale`, `aux_loss_coef`. The metrics logger writes them to
`metrics.jsonl` and TensorBoard (per-layer scalars; per-expert tables as histograms), and
`moetrain report` draws the expert-load heatmap with unused experts (x) and alarms (triangles) marked,
plus `expert_health.png` (CV, max/mean, top token fraction, entropy per layer).

The collapse alarm logs, on rank 0:

```
ROUTING COLLAPSE in MoE layer 3 (layers.3.feed_forward): expert 1 was chosen by 99.6% of the tokens in steps 11-20 (alarm above 75%; balanced would be 25.0%)
```

and with `collapse_aux_increase > 0` raises that layer's aux coefficient (up to `collapse_aux_max`,
kept in a persistent buffer). The threshold is a fraction of *tokens*: with top-2 a balanced expert
already gets 2/E of them, so the seeds' 50% is an alarm at 4x balance for E = 16 but only 2x for E = 8,
and it is switched off (with a warning) when k/E >= threshold.

## The experiment

    {command}

Model and budget, the same for every strategy: the `tiny` preset (4 blocks, dim 128, 8 experts top-2
of hidden 256 in every block, ~2.9M parameters), BPE 4096 on Shakespeare, 16 sequences of 256 tokens
per step, {steps} steps of AdamW (lr 1e-3, 15 warmup steps, cosine to 1e-4, weight decay 0.1, clip 1.0),
fp32, seed 0, on 2 forked gloo processes with the experts split over them (ep = 2, one thread each, on
a 2-core machine shared with other jobs, so tokens/s is only a rough comparison). Validation: 8 fixed
batches of the held-out split. Imbalance columns average the 4 layers over the second half of training
(the first steps mostly measure the random init). All-to-all MB/step: bytes the dispatcher sent,
summed over both ranks and all layers, dispatch and combine, with the default per-copy dispatcher;
once-per-rank: the same routing's traffic when each token is sent once per destination rank, as
`moe.dispatch_dedup: true` does, computed here from the routing (n/a for expert choice; measured
directly with the dispatcher in the section below). The collapse alarm ran with
threshold 0.75 (3x balance).

| strategy | setting | `moe:` overrides of the tiny preset |
|---|---|---|
{describe}

{table}
![load imbalance over steps](routing_load.png)

Validation loss, best first: {ranking}.

### Reading the numbers

* **No balancing collapses.** The first collapse alarm fired by step {first_alarm} (one layer's top
  expert was chosen by ~80% of the tokens, 100% a few windows later), {none_alarms} alarms in all,
  {none_unused} experts ended unused for 100+ steps, and the load CV stayed at {none_final_cv:.2f}
  (the hottest expert at {none_mm:.1f}x the mean). Its val loss ({none_loss:.3f}) is not the worst: at
  this size and budget collapse costs little quality. What it costs is expert-parallel step time (the
  rank holding the hot expert does ~{none_mm:.0f}x the mean work) and dead experts.
* **Aux loss 0.01** brings the CV down from the start and steadily ({aux_cv:.2f} averaged over the second
  half, {aux_final_cv:.2f} at the end, max/mean {aux_mm:.2f}), with no alarm, at a val loss of {aux_loss:.3f}.
* **The aux-loss-free bias** at DeepSeek-V3's rate (1e-3) starts out like no balancing (the bias moves
  each expert by at most 1e-3 per step): {bias_alarms} alarms early on, and only from step
  {bias_catches_up} on is it better balanced than the aux loss. From then on it is the best balanced
  token-choice run (last CV {bias_final_cv:.3f} against {aux_final_cv:.3f}), without any loss term
  competing with the language-model loss. Its val loss ({bias_loss:.3f}) pays for the ~{bias_catches_up}
  unbalanced steps of this short budget, which weigh less in a long run; a larger rate should shorten
  them (not measured here).
* **Expert choice** is balanced by construction (CV 0, max/mean 1.0): every expert does the same work
  at every step. But {ec_dropped:.1f}% of the tokens were chosen by no expert, it had the worst val loss
  ({ec_loss:.3f}), and its all-to-all moved {ec_extra_a2a:.1f} MB/step more than `aux_0.01`: the
  all-gathered (expert, score) pairs that make the global-batch cut.
* **Dynamic capacity** (with aux 0.01) settled at a factor of ~{dyn_factor:.2f} (the formula gives
  1.0 + 0.5 * sigmoid(std(load) - 1) with std(load) about the CV, so 1.13-1.5), dropped
  {dyn_dropped:.1f}% of the copies and ended {dyn_minus_aux:.3f} higher in val loss than the same run
  without a capacity limit (`aux_0.01`); the drops saved all-to-all bytes ({dyn_a2a:.1f} MB/step).
* **Two-level routing** (2 groups = the 2 ranks, 1 group per token) moved the same {two_a2a:.1f} MB/step
  as `aux_0.01` ({aux_a2a:.1f}) with the per-copy dispatcher, while the once-per-rank traffic
  (`moe.dispatch_dedup: true`) fell from {aux_once:.1f} to {two_once:.1f} MB/step. At 8 experts the limit cost {two_minus_aux:.3f} in
  val loss ({two_loss:.3f}); the seeds report its gain beyond 64 experts, which this run cannot test.
* **Per-expert LR compensation** (on top of aux 0.01): CV {lr_cv:.2f}, val loss {lr_loss:.3f}, within
  noise of aux 0.01 alone ({aux_loss:.3f}): with the aux loss keeping every expert busy there is
  little to compensate.
* **Tokens/s** ranged from {tps_min:.0f} to {tps_max:.0f}, but the 2 cores were shared with other jobs
  during the runs, so these differences are mostly contention, not the strategies.

### Which to use when

* **Always balance under expert parallelism.** Without it the router collapsed within the first
  {first_alarm} steps; the loss hardly noticed, but the hottest rank's share of the work did.
* **Aux loss 0.01 (softmax)** for short runs and fine-tuning: it balances from the start and gave the
  best val loss of the single methods here.
* **Aux-loss-free bias (sigmoid + `router_bias_update_rate`)** for long pre-training runs: it ends up the
  best balanced with no interference with the loss. At rate 1e-3 it needs ~{bias_catches_up} steps to undo
  the early collapse: for short runs use a larger rate or the aux loss.
* **Expert choice** only when equal expert work per step matters more than quality (a hard step-time
  budget under EP) and the model never decodes causally: it skips tokens and leaks batch information.
* **Dynamic capacity** only where memory forces a capacity limit: every drop costs quality, and the
  seeds' formula keeps the factor at 1.0-1.5 whatever the imbalance. Prefer dropless with a balancing
  method.
* **Two-level routing** with many experts (the seeds: > 64) together with `moe.dispatch_dedup: true`,
  which sends a token once per destination rank (DeepSeek-V3's node limit); set `num_expert_groups` to
  the number of ep ranks or nodes. Without dedup the per-copy dispatcher moves as many bytes as before.
* **Per-expert LR compensation** as a repair for experts that stay under-used (watch `unused_experts`
  and `expert_lr_scale`); with a working balancing method it changes little.
* **Keep the health monitor on** (one small all-reduce per log step) with `collapse_threshold` a few
  times above k/E; `collapse_aux_increase` turns the alarm into an automatic correction.

## Limitations

* Jitter and noise draw from each rank's RNG: runs with them are not layout-invariant.
* The once-per-rank column of the table is computed from the routing of these runs; the dispatcher's
  measured bytes with and without `moe.dispatch_dedup` are in the next section.
* The balancer's window, idle counters and load history are not checkpointed (the bias, capacity
  factor, learning-rate scales and raised aux coefficients are); after a resume the first interval
  starts empty.
* One seed, {steps} steps, a tiny model: differences of a few hundredths in val loss are within noise.

## Once-per-rank dispatch, measured

`python benchmarks/dispatch_dedup.py --steps 20` (the demo model, ep=2 on 2 processes, 20 steps per
setting; bytes rank 0 sent and received in the forward exchanges, from the dispatcher's counters):

| routing | per-copy MB/step (rank 0) | once-per-rank MB/step | saved | loss after 20 steps |
|---|---|---|---|---|
| top-2 (softmax) | 15.97 | 12.52 | 22% | 7.8300 / 7.8300 |
| group-limited (2 groups = the 2 ranks, 1 per token) | 16.03 | 8.21 | 49% | 7.8374 / 7.8374 |

With dedup a token's copies on one rank share one row each way (their weighted outputs are summed on
that rank before the way back), at 12 bytes of metadata per copy; the losses are equal and
`tests/distributed/test_expert_parallel.py` checks outputs, gradients and parameters against one
process with dedup on (dropless, with drops, with shared experts, at ep=2 and dp=2 x ep=2).
"""


if __name__ == "__main__":
    main()
