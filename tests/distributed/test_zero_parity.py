"""ZeRO stages 0-3 x expert parallelism on real gloo processes against one plain process with the
same global batch and weights (see zero_parity.py).

fp32: the loss and the global gradient norm of every step within 1e-5 relative (measured: about
2e-7 and 5e-6), every parameter after 10 AdamW steps within 1e-4 (measured: about 1e-5).
bf16/fp16 (stated loose tolerance): the loss of every step within 2% of the fp32 single-process
loss (measured: at most 0.6% over 10 steps, where the loss falls by 14%).

One process start per world size, every run inside it: start-up, not the tiny model, is the cost.
"""

import pytest

from tests.distributed.workers.zero_parity import Run, assert_matches, run_reference
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FP32_RTOL = 1e-5
PARAM_RTOL = 1e-4
LOW_PRECISION_LOSS_RTOL = 2e-2


def _check(runs, results, *, low_precision=()):
    refs = {}
    for run in runs:
        key = (run.micro_batches, tuple(sorted(run.moe.items())), run.steps)
        if key not in refs:
            refs[key] = run_reference(Run("ref", 0, steps=run.steps, micro_batches=run.micro_batches, moe=run.moe))
        ref = refs[key]
        if run.name in low_precision:
            for r, res in enumerate(results):
                for s, (a, b) in enumerate(zip(res[run.name]["loss"], ref["loss"], strict=True)):
                    assert abs(a - b) <= LOW_PRECISION_LOSS_RTOL * abs(b), \
                        f"[{run.name}] rank {r} step {s}: loss {a} vs fp32 {b}"
            continue
        assert_matches(run, results, ref, rtol=FP32_RTOL, param_rtol=PARAM_RTOL)


def test_zero_stages_world2():
    runs = [Run(f"stage{s}_ep{ep}", s, ep=ep) for s in (0, 1, 2, 3) for ep in (1, 2)]
    runs += [
        # Gradient accumulation (no_sync / set_requires_gradient_sync) with each checkpointing mode.
        Run("stage3_accum_ac_full", 3, ep=2, steps=4, micro_batches=2, ac="full"),
        Run("stage2_accum_ac_moe", 2, ep=2, steps=4, micro_batches=2, ac="moe"),
        Run("stage1_accum_ac_every_n", 1, ep=2, steps=4, micro_batches=2, ac="every_n"),
        # Offload: ZeRO-1's host slices; FSDP2's CPUOffloadPolicy at stages 2 and 3.
        Run("stage1_offload_optimizer", 1, ep=2, steps=4, offload_optimizer=True),
        Run("stage2_offload_optimizer", 2, ep=2, steps=4, offload_optimizer=True),
        Run("stage3_offload_params", 3, ep=2, steps=4, offload_params=True),
    ]
    low = [Run(f"{dt}_stage{s}", s, ep=2, dtype=dt) for dt in ("bf16", "fp16") for s in (0, 1, 2, 3)]
    results = run_ranks(_worker, 2, runs + low, timeout_s=200)
    _check(runs + low, results, low_precision={r.name for r in low})


def test_zero_stages_world4():
    runs = [Run(f"stage{s}_ep{ep}", s, ep=ep) for s in (0, 1, 2, 3) for ep in (1, 2)]
    runs += [
        # edp = 1: the expert unit is a one-rank FSDP unit (the force-sum double-divide trap).
        Run("stage3_ep4", 3, ep=4, steps=4),
        Run("stage1_ep4", 1, ep=4, steps=4),
        # HSDP: dense units shard over 2 ranks and replicate over 2.
        Run("stage3_hsdp", 3, ep=2, steps=4, hsdp_replicate=2),
        Run("stage2_hsdp_ep1", 2, ep=1, steps=4, hsdp_replicate=2),
        # One local expert per rank, edp = 2: experts shard on dim 1 instead of dim 0.
        Run("stage3_experts_dim1", 3, ep=2, steps=4, moe={"num_experts": 2, "top_k": 1}),
        Run("stage1_experts_dim1", 1, ep=2, steps=4, moe={"num_experts": 2, "top_k": 1}),
    ]
    _check(runs, run_ranks(_worker, 4, runs, timeout_s=200))


def _worker(rank, world_size, runs):
    from tests.distributed.workers.zero_parity import zero_worker

    return zero_worker(rank, world_size, runs)
