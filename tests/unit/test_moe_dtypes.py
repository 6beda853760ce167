"""Under autocast the MoE layer computes in the autocast dtype where autocast itself cannot reach:
the dispatch payload, the grouped expert GEMM (``torch._grouped_mm`` is not an autocast op), the
shared experts and the combine; the router stays fp32; master weights get fp32 gradients. Without
autocast nothing changes. The dtypes are recorded below autocast (``DtypeRecorder``), so they are
what the kernels received. Tensors are tiny: bf16 matmuls are ~100x slower than fp32 on this CPU.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import GroupedExperts, MoELayer
from moetrain.models.moe.experts import to_autocast_dtype
from tests.distributed.workers.dtype_probe import DtypeRecorder

DIM, HIDDEN, NUM_EXPERTS, TOP_K, TOKENS = 16, 16, 4, 2, 12
LOW = [torch.bfloat16, torch.float16]


def _layer(**overrides) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(**{"num_experts": NUM_EXPERTS, "top_k": TOP_K, "expert_hidden_dim": HIDDEN,
                       "num_shared_experts": 1, **overrides})
    return MoELayer(DIM, cfg)


def _x() -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _floats(seen, where: str) -> set[torch.dtype]:
    return {d for s in seen if s.where == where for d in s.dtypes if d.is_floating_point}


@pytest.mark.parametrize("dtype", LOW)
def test_to_autocast_dtype(dtype):
    x32, x64, ids = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.int64)
    assert to_autocast_dtype(x32) is x32  # no autocast: the same tensor, not a copy
    with torch.autocast("cpu", dtype=dtype):
        assert to_autocast_dtype(x32).dtype == dtype
        assert to_autocast_dtype(x64) is x64  # autocast leaves fp64 alone too
        assert to_autocast_dtype(ids) is ids
    with torch.autocast("cpu", dtype=dtype, enabled=False):
        assert to_autocast_dtype(x32) is x32


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("dtype", LOW)
def test_experts_compute_in_autocast_dtype_with_fp32_master_gradients(impl, dtype):
    """fp32 input, fp32 weights, autocast on: both GEMM operands in the autocast dtype on the grouped
    path and on its oracle alike, and the gradients reach the fp32 master weights in fp32."""
    experts = GroupedExperts(DIM, HIDDEN, NUM_EXPERTS, activation="swiglu", impl=impl)
    x_MD = _x()
    counts_E = torch.tensor([3, 0, 5, 4])
    recorder = DtypeRecorder()
    with recorder:
        with torch.autocast("cpu", dtype=dtype):
            y_MD = experts(x_MD, counts_E)
        y_MD.float().sum().backward()
    assert y_MD.dtype == dtype
    ops = {s.op for s in recorder.seen}
    assert ("_grouped_mm" in ops) == (impl == "grouped"), ops
    grouped = [s for s in recorder.seen if s.op == "_grouped_mm"]
    assert {s.backward for s in grouped} == ({False, True} if impl == "grouped" else set())
    assert all({d for d in s.dtypes if d.is_floating_point} == {dtype} for s in grouped), grouped
    for w in (experts.w1, experts.w2, experts.w3):
        assert w.dtype == torch.float32 and w.grad.dtype == torch.float32
        assert w.grad.abs().sum() > 0
    assert x_MD.grad.dtype == torch.float32


def test_grouped_and_loop_agree_under_autocast():
    """The oracle and the fast path compute the same bf16 products (before, the loop's matmuls were
    autocast to bf16 while the grouped GEMM ran in fp32)."""
    grouped = GroupedExperts(DIM, HIDDEN, NUM_EXPERTS, impl="grouped")
    loop = GroupedExperts(DIM, HIDDEN, NUM_EXPERTS, impl="loop")
    loop.load_state_dict(grouped.state_dict())
    x_MD, counts_E = _x().detach(), torch.tensor([3, 0, 5, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = grouped(x_MD, counts_E), loop(x_MD, counts_E)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_layer_under_autocast(dtype, impl):
    """One device (LocalDispatcher): the gathered rows, the expert GEMMs and the shared expert in
    the autocast dtype; the router's matmul and logits in fp32 and equal to those without autocast;
    all parameter gradients fp32."""
    layer = _layer(expert_impl=impl)
    x_TD = _x()
    logits_fp32 = layer.router(x_TD.detach()).logits_TE
    recorder = DtypeRecorder()
    handles = recorder.watch(layer)
    with recorder:
        with torch.autocast("cpu", dtype=dtype):
            out_TD, aux = layer(x_TD)
        (out_TD.float().sum() + aux.loss).backward()
    for h in handles:
        h.remove()
    assert out_TD.dtype == dtype
    assert _floats(recorder.seen, "gemm") == {dtype}
    assert _floats(recorder.seen, "shared") == {dtype}
    assert _floats(recorder.seen, "router") == {torch.float32}
    assert _floats(recorder.seen, "router_logits") == {torch.float32}
    with torch.autocast("cpu", dtype=dtype):
        logits_autocast = layer.router(x_TD.detach()).logits_TE
    assert torch.equal(logits_autocast, logits_fp32)
    for name, p in layer.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
    assert x_TD.grad.dtype == torch.float32


def test_layer_without_autocast_is_unchanged():
    """fp32 without autocast: no cast anywhere (every op sees fp32), the same output twice."""
    layer = _layer()
    x_TD = _x().detach()
    recorder = DtypeRecorder()
    handles = recorder.watch(layer)
    with recorder:
        out_TD, _ = layer(x_TD)
    for h in handles:
        h.remove()
    assert out_TD.dtype == torch.float32
    for where in ("gemm", "shared", "router", "router_logits"):
        assert _floats(recorder.seen, where) == {torch.float32}, where
    assert torch.equal(layer(x_TD)[0], out_TD)


@pytest.mark.parametrize("dtype", LOW)
def test_fixed_bias_and_shared_gate_under_autocast(dtype):
    """The trainer's mixed precision (autocast over fp32 parameters): the selection bias stays
    fp32 and selects as without autocast; the gated shared experts compute in the autocast dtype;
    every parameter, the shared gate's included, gets an fp32 gradient."""
    layer = _layer(router="sigmoid", expert_bias=True, shared_expert_gate=True, routed_scaling_factor=2.5)
    layer.router.expert_bias.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
    x_TD = _x()
    idx_fp32 = layer.router(x_TD.detach()).idx_TK
    with torch.autocast("cpu", dtype=dtype):
        out_TD, aux = layer(x_TD)
        idx_TK = layer.router(x_TD.detach()).idx_TK
        shared_TD = layer._shared(to_autocast_dtype(x_TD.detach()))
    assert out_TD.dtype == shared_TD.dtype == dtype
    assert torch.equal(idx_TK, idx_fp32)
    assert layer.router.expert_bias.dtype == torch.float32
    (out_TD.float().sum() + aux.loss).backward()
    for name, p in layer.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
    assert layer.shared_gate.weight.grad.abs().sum() > 0
