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
import torch

from tests.distributed.workers.zero_parity import Run
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
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


def _leaks(seen, where: str, expected: torch.dtype) -> list:
    return [s for s in seen if s.where == where and any(d.is_floating_point and d != expected for d in s.dtypes)]


def _check_run(run: Run, res: dict, rank: int) -> None:
    compute = _COMPUTE[run.dtype]
    seen = res["seen"]
    tag = f"[{run.name}] rank {rank}"
    # Token rows: 2-D floating payloads. Gate weights (1-D, dedup only) keep the router's fp32.
    rows = [s for s in seen if s.where == "payload" and len(s.shapes[0]) == 2 and s.dtypes[0].is_floating_point]
    assert {s.backward for s in rows} == {False, True}, f"{tag}: token all-to-alls seen {rows}"
    leaks = [s for s in rows if s.dtypes[0] != compute]
    assert not leaks, f"{tag}: token rows sent in the wrong dtype: {leaks}"
    gates = [s for s in seen if s.where == "payload" and len(s.shapes[0]) == 1 and s.dtypes[0].is_floating_point]
    assert all(s.dtypes[0] == torch.float32 for s in gates), f"{tag}: gate weights not fp32: {gates}"
    assert bool(gates) == run.moe.get("dispatch_dedup", False), f"{tag}: gate-weight exchanges {gates}"
    for where, expected in (("gemm", compute), ("shared", compute), ("router", torch.float32),
                            ("router_weight", torch.float32), ("router_logits", torch.float32)):
        assert any(s.where == where for s in seen), f"{tag}: no {where} op recorded"
        leaks = _leaks(seen, where, expected)
        assert not leaks, f"{tag}: {where} not in {expected}: {leaks[:4]}"
    grouped = run.moe.get("expert_impl", "grouped") == "grouped"
    assert any(s.op == "_grouped_mm" for s in seen) == grouped, f"{tag}: grouped path used: {not grouped}"
    # Backward GEMMs are recorded for the grouped path (its op is seen wherever it runs); the
    # loop's backward matmuls have no module scope to tell them from the attention's.
    gemm_phases = {s.backward for s in seen if s.where == "gemm"}
    assert gemm_phases == ({False, True} if grouped else {False}), f"{tag}: expert GEMM phases {gemm_phases}"
    for what in ("params", "grads"):
        wrong = {n: d for n, d in res[what].items() if d != torch.float32}
        assert not wrong, f"{tag}: {what} not fp32: {wrong}"
    assert set(res["grads"]) == set(res["params"]), f"{tag}: parameters without a gradient"
    assert res["optimizer_states"] == {torch.float32}, f"{tag}: optimizer states {res['optimizer_states']}"


@pytest.mark.parametrize("name", [r.name for r in _runs()])
def test_compute_dtype_reaches_experts_and_wire(recorded, name):
    runs, results = recorded
    run = next(r for r in runs if r.name == name)
    for rank, res in enumerate(results):
        _check_run(run, res[name], rank)


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
