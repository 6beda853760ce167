"""``train.compile`` on CPU: training tokens per second of the demo config compiled and eager, in
one run.

    python benchmarks/compile.py [--ep 2] [--steps 10] [--warmup 3] [--json]

The demo config (``moetrain demo``: moetrain/configs/tiny.yaml) is the "tiny" preset (4 MoE
blocks, dim 128, 8 experts top-2), vocabulary 4096, 8 sequences of 256 tokens per process, fp32,
experts split over 2 processes (ep = 2, one thread each, gloo). ``--ep 1`` runs one process on
the same global batch (16 sequences) instead: no graph break inside a block there.

Each process builds the model (same seed) twice: eager, then with ``compile=True`` passed to
``parallelize`` (every block through inductor). A step is a whole training step: forward, loss,
backward (with DDP's gradient all-reduce at ep = 2), AdamW. The first ``--warmup`` steps of each
variant are not timed (they compile, and the second step recompiles what a changed count made
dynamic); the figure is the median of the next ``--steps``, of the slower rank. The input is
random token ids, drawn once: the same batches for both variants.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from moetrain.config.loader import load_config
from moetrain.distributed import ParallelDims, parallelize
from moetrain.models.transformer import Transformer
from moetrain.train.optim import build_optimizer

DEMO = "tiny"
"""The shipped config ``moetrain demo`` trains."""
GLOBAL_SEQUENCES = 16


def _batches(num_steps: int, vocab_size: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (num_steps, GLOBAL_SEQUENCES, seq_len + 1), generator=g)


def _time_steps(compile: bool, dims: ParallelDims, rank: int, batches: torch.Tensor, warmup: int
                ) -> tuple[list[float], float]:
    """Seconds of each timed step and of the warm-up steps together (compilation included)."""
    cfg = load_config(DEMO)
    model = Transformer(cfg.model.with_vocab_size(cfg.data.vocab_size), moe=cfg.moe, seed=0)
    train_model = parallelize(model, dims, compile=compile)
    o = cfg.optim
    opt = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps)
    per_rank = GLOBAL_SEQUENCES // dims.world_size
    times = []
    for tokens in batches:
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        if dims.world_size > 1:
            dist.barrier()  # start together: otherwise a rank's wait for its peer counts as its work
        t0 = time.perf_counter()
        out = train_model(mine[:, :-1], mine[:, 1:])
        out.total_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[warmup:], sum(times[:warmup])


def _measure(rank: int, world: int, steps: int, warmup: int) -> torch.Tensor:
    """[eager median step s, eager warm-up s, compiled median step s, compiled warm-up s] of every
    rank (an all-gather: every rank gets all rows)."""
    cfg = load_config(DEMO)
    dims = ParallelDims(world_size=world, ep=world, num_experts=cfg.moe.num_experts)
    dims.build_mesh("cpu")
    batches = _batches(warmup + steps, cfg.data.vocab_size, cfg.data.seq_len)
    row = []
    for compile in (False, True):
        times, warm = _time_steps(compile, dims, rank, batches, warmup)
        row += [statistics.median(times), warm]
    mine = torch.tensor(row, dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return torch.stack(gathered)


def _rank(rank: int, world: int, init_file: str, steps: int, warmup: int, out_q) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        rows = _measure(rank, world, steps, warmup)
        if rank == 0:
            buf = io.BytesIO()
            torch.save(rows, buf)
            out_q.put((True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent waits on the queue: report anything
        out_q.put((False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _per_rank(ep: int, steps: int, warmup: int) -> torch.Tensor:
    ctx = mp.get_context("fork")
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, ep, os.path.join(tmp, "store"), steps, warmup, out_q))
                 for r in range(ep)]
        for p in procs:
            p.start()
        ok, payload = out_q.get(timeout=3600)
        if not ok:
            raise RuntimeError(f"a rank failed:\n{payload}")
        for p in procs:
            p.join()
    return torch.load(io.BytesIO(payload))


def run(ep: int, steps: int, warmup: int) -> dict:
    per_rank = _per_rank(ep, steps, warmup)
    cfg = load_config(DEMO)
    tokens_per_step = GLOBAL_SEQUENCES * cfg.data.seq_len
    eager_s, compiled_s = per_rank[:, 0].max().item(), per_rank[:, 2].max().item()
    return {
        "config": DEMO, "ep": ep, "tokens_per_step": tokens_per_step, "timed_steps": steps,
        "eager_step_s": round(eager_s, 4), "compiled_step_s": round(compiled_s, 4),
        "eager_tokens_per_s": round(tokens_per_step / eager_s, 1),
        "compiled_tokens_per_s": round(tokens_per_step / compiled_s, 1),
        "ratio": round(eager_s / compiled_s, 3),
        "eager_warmup_s": round(per_rank[:, 1].max().item(), 1),
        "compiled_warmup_s": round(per_rank[:, 3].max().item(), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, default=2, choices=(1, 2), help="processes, experts split over all (default 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compile, recompile)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args()
    result = run(a.ep, a.steps, a.warmup)
    if a.json:
        print(json.dumps(result), flush=True)
        return
    print(f"demo config ({DEMO}, ep={a.ep}, {result['tokens_per_step']} tokens/step, fp32, CPU): "
          f"eager {result['eager_tokens_per_s']} tokens/s, compiled {result['compiled_tokens_per_s']} tokens/s, "
          f"compiled/eager {result['ratio']}x (medians of {a.steps} steps; warm-up {result['eager_warmup_s']} s "
          f"eager, {result['compiled_warmup_s']} s compiled)", flush=True)


if __name__ == "__main__":
    main()
