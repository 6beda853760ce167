"""How long a checkpoint stops training, synchronous vs ``checkpoint.async_save``, in one run.

    OMP_NUM_THREADS=2 python benchmarks/checkpoint_stall.py [--steps 13] [--every 4] [--out /tmp/stall]

Trains the same model twice in this process (an MoE of ~57M fp32 parameters by default, so that a
checkpoint of weights and AdamW moments is ~0.7 GB), saving every ``--every`` steps, once with
synchronous saves and once with async ones. The stall of a checkpoint is the time the training loop
spends in ``Checkpointer.save`` (sync: the whole write; async: waiting for the previous save, then
staging a CPU copy) plus, for async, the per-step ``poll`` until that save is published. The save
at the end of the run is waited for (and reported apart): a run does not return before its last
checkpoint is published. Also printed: the median and total time of the training steps (async
ones run beside the background write, which shares the CPU), the run's wall time from the first
step (logging included) and the size of one checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from moetrain.config.loader import load_config
from moetrain.train.checkpoint.checkpointer import Checkpointer
from moetrain.train.trainer import Trainer


def _overrides(args: argparse.Namespace, run_dir: Path, *, async_save: bool) -> list[str]:
    return [
        f"--model.dim={args.dim}", f"--model.num_layers={args.layers}", "--model.num_heads=8",
        "--model.max_seq_len=64", f"--moe.num_experts={args.experts}", "--moe.top_k=2",
        f"--moe.expert_hidden_dim={args.expert_hidden}",
        "--data.corpus=shakespeare", "--data.tokenizer=bytes", "--data.seq_len=64",
        f"--train.steps={args.steps}", "--train.global_batch_size=4", "--train.micro_batch_size=4",
        "--train.eval_every=0", "--train.device=cpu", "--optim.schedule=constant",
        f"--checkpoint.every={args.every}", "--checkpoint.keep_last=1", "--checkpoint.save_final=false",
        f"--checkpoint.async_save={'true' if async_save else 'false'}",
        f"--log.run_dir={run_dir}", "--log.every=1", "--log.progress_bar=false", "--log.tensorboard=false",
    ]


class _Timer:
    """Seconds the loop spends in each checkpointing call, and in each training step."""

    def __init__(self) -> None:
        self.saves: list[float] = []
        self.polls = 0.0
        self.final_wait = 0.0
        self.steps: list[float] = []

    def install(self) -> None:
        timer = self
        save, poll, wait, train_step = Checkpointer.save, Checkpointer.poll, Checkpointer.wait, Trainer.train_step

        def timed_save(self, snapshot, **kw):
            t0 = time.perf_counter()
            out = save(self, snapshot, **kw)
            timer.saves.append(time.perf_counter() - t0)
            return out

        def timed_poll(self):
            t0 = time.perf_counter()
            poll(self)
            timer.polls += time.perf_counter() - t0

        def timed_wait(self):
            t0 = time.perf_counter()
            wait(self)
            timer.final_wait += time.perf_counter() - t0

        def timed_step(self):
            t0 = time.perf_counter()
            train_step(self)
            timer.steps.append(time.perf_counter() - t0)

        Checkpointer.save, Checkpointer.poll, Checkpointer.wait = timed_save, timed_poll, timed_wait  # type: ignore[method-assign]
        Trainer.train_step = timed_step  # type: ignore[method-assign]


def _run(args: argparse.Namespace, *, async_save: bool) -> dict:
    run_dir = Path(args.out) / ("async" if async_save else "sync")
    shutil.rmtree(run_dir, ignore_errors=True)
    trainer = Trainer(load_config(None, _overrides(args, run_dir, async_save=async_save)))
    timer = _Timer()
    originals = (Checkpointer.save, Checkpointer.poll, Checkpointer.wait, Trainer.train_step)
    timer.install()
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        Checkpointer.save, Checkpointer.poll, Checkpointer.wait, Trainer.train_step = originals  # type: ignore[method-assign]
    wall = time.perf_counter() - t0
    params = sum(p.numel() for p in trainer.model.parameters())
    ckpt = max((trainer.run_dir / "checkpoints").glob("step_*"))
    trainer.metrics.close()
    saves = len(timer.saves)
    return {"mode": "async" if async_save else "sync", "params_M": params / 1e6,
            "checkpoint_MB": sum(f.stat().st_size for f in ckpt.iterdir()) / 1e6, "saves": saves,
            "stall_per_checkpoint_s": (sum(timer.saves) + timer.polls) / saves,
            "save_call_s": [round(s, 3) for s in timer.saves],
            "end_wait_s": timer.final_wait, "median_step_s": statistics.median(timer.steps),
            "steps_s": sum(timer.steps), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-hidden", type=int, default=1024)
    p.add_argument("--out", default="/tmp/moetrain-checkpoint-stall")
    p.add_argument("--json", action="store_true", help="print one JSON line per mode")
    args = p.parse_args()
    rows = [_run(args, async_save=False), _run(args, async_save=True)]
    for mode in ("sync", "async"):  # what the runs wrote; the folder itself may hold the user's files
        shutil.rmtree(Path(args.out) / mode, ignore_errors=True)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{rows[0]['params_M']:.1f}M parameters, checkpoint {rows[0]['checkpoint_MB']:.0f} MB, "
          f"{torch.get_num_threads()} thread(s), a save every {args.every} of {args.steps} steps")
    print(f"{'mode':6} {'stall/ckpt s':>12} {'end wait s':>10} {'median step s':>13} {'all steps s':>11} "
          f"{'wall s':>7}  save calls s")
    for r in rows:
        print(f"{r['mode']:6} {r['stall_per_checkpoint_s']:12.3f} {r['end_wait_s']:10.3f} {r['median_step_s']:13.3f} "
              f"{r['steps_s']:11.1f} {r['wall_s']:7.1f}  {r['save_call_s']}")
    print(f"stall ratio async / sync: {rows[1]['stall_per_checkpoint_s'] / rows[0]['stall_per_checkpoint_s']:.3f}")


if __name__ == "__main__":
    main()
