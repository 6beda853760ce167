"""bf16/fp16 reach the experts and the wire at every ZeRO stage (ep = 2, world 2, real gloo ranks).

The dtypes are recorded below autocast and autograd (``dtype_probe.DtypeRecorder``), for one
training step of the ZeRO harness's model with a shared expert: a loss within 2% of fp32 cannot
tell a bf16 expert GEMM from an fp32 one, these records can. Under bf16/fp16, at stages 0-3:

* every all-to-all of token rows (dispatch and combine, forward and backward) carries the compute
  dtype; the gate weights that travel with ``dispatch_dedup`` stay fp32 (router precision);
* every expert GEMM (grouped and per-expert loop) and every shared-expert matmul gets the compute
  dtype for both operands;
* the router's matmul, its gate weight as gathered (an fp32 FSDP unit at stages 2/3) and its logits
  are fp32;
* master weights, their gradients and the AdamW states are fp32.

And the byte counters: one MoE layer under bf16 moves half the token-row bytes of fp32.
"""

import pytest

from tests.distributed.workers.dtype_probe import check_recorded_dtypes
from tests.distributed.workers.zero_parity import Run
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_SHARED = {"num_shared_experts": 1}


def _runs() -> list[Run]:
    runs = [Run(f"{dt}_stage{s}", s, ep=2, dtype=dt, steps=1, moe=_SHARED)
            for dt in ("bf16", "fp16") for s in (0, 1, 2, 3)]
    runs += [
        # The per-expert loop (the grouped path's oracle) and the once-per-rank exchange.
        Run("bf16_stage0_loop", 0, ep=2, dtype="bf16", steps=1, moe={**_SHARED, "expert_impl": "loop"}),
        Run("bf16_stage3_loop", 3, ep=2, dtype="bf16", steps=1, moe={**_SHARED, "expert_impl": "loop"}),
        Run("bf16_stage1_dedup", 1, ep=2, dtype="bf16", steps=1, moe={**_SHARED, "dispatch_dedup": True}),
        Run("bf16_stage2_dedup", 2, ep=2, dtype="bf16", steps=1, moe={**_SHARED, "dispatch_dedup": True}),
        # Control: the recorder sees fp32 everywhere when nothing asks for less.
        Run("fp32_stage0", 0, ep=2, steps=1, moe=_SHARED),
    ]
    return runs


def _dtype_worker(rank, world_size, runs):
    from tests.distributed.workers.dtype_probe import dtype_worker

    return dtype_worker(rank, world_size, runs)


def _bytes_worker(rank, world_size):
    from tests.distributed.workers.dtype_probe import bytes_worker

    return bytes_worker(rank, world_size)


@pytest.fixture(scope="module")
def recorded():
    runs = _runs()
    return runs, run_ranks(_dtype_worker, 2, runs, timeout_s=200)


@pytest.mark.parametrize("name", [r.name for r in _runs()])
def test_compute_dtype_reaches_experts_and_wire(recorded, name):
    runs, results = recorded
    run = next(r for r in runs if r.name == name)
    for rank, res in enumerate(results):
        check_recorded_dtypes(run, res[name], f"[{run.name}] rank {rank}")


def test_bf16_halves_token_bytes():
    """The same input and routing (the router is fp32 either way): the token rows are half the
    bytes; the routing counts (int64, one ``[L]`` row per peer) are the same."""
    results = run_ranks(_bytes_worker, 2, timeout_s=120)
    for rank, res in enumerate(results):
        fp32, bf16 = res["fp32"], res["bf16"]
        assert [s.shapes for s in fp32["seen"]] == [s.shapes for s in bf16["seen"]], \
            f"rank {rank}: different exchanges (routing changed?)"
        count_bytes = (2 - 1) * fp32["num_local_experts"] * 8  # one count exchange per dispatch, one peer
        for key, counts in (("bytes_sent", count_bytes), ("bytes_received", count_bytes),
                            ("min_bytes", 2 * count_bytes)):
            rows32, rows16 = fp32[key] - counts, bf16[key] - counts
            assert rows32 > 0, f"rank {rank}: no token rows counted in {key}"
            assert 2 * rows16 == rows32, f"rank {rank}: {key} token rows bf16 {rows16} vs fp32 {rows32}"
