"""The all-to-all dispatcher and its wire formats on CUDA tensors over NCCL, at world 1.

One rank is enough for what the CPU runs cannot show: every exchange (counts, token rows, row ids,
gate weights, the capacity all-gather) goes through NCCL on device buffers, so a buffer left on
the host, a dtype NCCL refuses or a missing wait fails here. The layer with the all-to-all
dispatcher must then equal the same layer with the local one: exactly up to fp32 summation order
without compression, and within the first-order bound of tests/distributed/test_dispatch_dtype.py
with a compressed wire. The fp8 format itself is byte-for-byte the CPU's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moetrain.distributed import AllToAllDispatcher
from moetrain.distributed.expert_parallel.exchange import launch_rows
from moetrain.distributed.expert_parallel.wire import exchange_rows, pack_e4m3, unpack_e4m3
from tests.distributed.workers.zero_parity import rel_err
from tests.unit.test_moe_equivalence import inputs, make_config, make_layers, run_layer

pytestmark = pytest.mark.cuda

DIM, HIDDEN, NUM_EXPERTS, TOKENS = 64, 128, 8, 64
# Norm-wise relative, first order in the roundings a routed value crosses (see
# tests/distributed/test_dispatch_dtype.py): bf16 2^-9 each, e4m3 2^-4 for the dispatch.
TOLERANCE = {"bf16": 3 * 2.0**-9, "fp8_e4m3": 2.0**-4 + 2 * 2.0**-9}
MODES = {
    "dropless": {},
    "capacity_score": {"capacity_factor": 0.75, "drop_policy": "score"},
    "capacity_position": {"capacity_factor": 1.0},
    "dedup": {"dispatch_dedup": True},
}


def _local_and_all_to_all(device, group, moe: dict):
    """The same layer twice on ``device``: with its local dispatcher, and with the all-to-all one
    over ``group`` (as the data-parallel group too when capacity needs the global drops)."""
    cfg = make_config(num_experts=NUM_EXPERTS, expert_hidden_dim=HIDDEN, activation="swiglu",
                      num_shared_experts=1, **moe)
    local, _ = make_layers(cfg, DIM)
    local = local.to(device)
    ep = copy.deepcopy(local)
    ep.dispatcher = AllToAllDispatcher(cfg.num_experts, ep_group=group,
                                       dp_group=group if cfg.capacity_factor is not None else None,
                                       dedup=cfg.dispatch_dedup, dispatch_dtype=cfg.dispatch_dtype)
    return local, ep


@pytest.mark.parametrize("mode", list(MODES))
def test_all_to_all_dispatcher_over_nccl_equals_the_local_one(device, nccl_world, mode):
    local, ep = _local_and_all_to_all(device, nccl_world, MODES[mode])
    x, grad_out = (t.to(device) for t in inputs((TOKENS, DIM)))
    want = run_layer(local, x, grad_out)
    out, aux, x_grad, grads = run_layer(ep, x, grad_out)
    assert out.device == x.device
    assert aux.num_routed_per_expert.tolist() == want[1].num_routed_per_expert.tolist()
    assert int(aux.num_dropped) == int(want[1].num_dropped)
    if mode.startswith("capacity"):
        assert int(aux.num_dropped) > 0, "the capacity case must actually drop copies"
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, want[0], **tol)
    torch.testing.assert_close(aux.loss, want[1].loss, **tol)
    torch.testing.assert_close(x_grad, want[2], **tol)
    assert grads.keys() == want[3].keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want[3][name], **tol, msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("wire", list(TOLERANCE))
@pytest.mark.parametrize("mode", ["dropless", "dedup"])
def test_compressed_wire_over_nccl_within_its_bound(device, nccl_world, wire, mode):
    local, ep = _local_and_all_to_all(device, nccl_world, {"dispatch_dtype": wire, **MODES[mode]})
    x, grad_out = (t.to(device) for t in inputs((TOKENS, DIM)))
    want = run_layer(local, x, grad_out)
    out, aux, x_grad, grads = run_layer(ep, x, grad_out)
    assert aux.num_routed_per_expert.tolist() == want[1].num_routed_per_expert.tolist()
    errors = {"output": rel_err(out, want[0]), "grad of the input": rel_err(x_grad, want[2]),
              **{f"grad of {n}": rel_err(g, want[3][n]) for n, g in grads.items()}}
    assert max(errors.values()) <= TOLERANCE[wire], errors
    assert errors["output"] > 1e-5, f"no rounding seen: the {wire} wire did not run ({errors})"


def test_fp8_wire_bytes_on_cuda_equal_the_cpu_ones(device):
    # Rows spanning six decades, D = 300: three scale blocks per row, the last one partial.
    g = torch.Generator().manual_seed(0)
    x_MD = torch.randn(64, 300, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x_MD[3] = 0.0  # an all-zero row keeps scale 1
    packed = pack_e4m3(x_MD.to(device))
    assert packed.device.type == device.type and packed.dtype == torch.uint8
    # IEEE division and the same round-to-nearest-even e4m3 cast on both: the same bytes, so a
    # CPU-made expectation (tests/unit/test_dispatch_quant.py) holds on the GPU as well.
    assert torch.equal(packed.cpu(), pack_e4m3(x_MD))
    for dtype in (torch.float32, torch.bfloat16):
        back = unpack_e4m3(packed, 300, dtype)
        assert back.dtype == dtype and back.device == packed.device
        assert torch.equal(back.cpu(), unpack_e4m3(pack_e4m3(x_MD), 300, dtype))
    normal = x_MD.abs() >= 2.0**-6 * x_MD.abs().amax(dim=1, keepdim=True) / 448
    err = (unpack_e4m3(packed, 300, torch.float32).cpu() - x_MD).abs()
    assert (err[normal] <= 2.0**-4 * x_MD.abs()[normal] * (1 + 1e-6)).all()


def _launched(x_MD, **kwargs):
    return launch_rows(x_MD, **kwargs).wait()


@pytest.mark.parametrize("send", [_launched, exchange_rows], ids=["launch_rows", "exchange_rows"])
def test_fp8_exchange_over_nccl_sends_the_packed_rows_and_a_bf16_gradient(device, nccl_world, send):
    """Both ways rows travel: launched and waited for (the dispatcher's), and in one call (the
    hierarchical exchange's)."""
    x_MD = torch.randn(48, 192, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    grad_MD = torch.randn(48, 192, generator=torch.Generator().manual_seed(2)).to(device)
    # One rank: rows 0..47 go to itself, so what arrives is exactly the decoded wire.
    y_MD = send(x_MD, wire="fp8_e4m3", output_splits=[48], input_splits=[48], group=nccl_world)
    assert y_MD.dtype == torch.float32 and y_MD.device == x_MD.device
    assert torch.equal(y_MD, unpack_e4m3(pack_e4m3(x_MD.detach()), 192, torch.float32))
    y_MD.backward(grad_MD)
    # Straight-through, sent back in bf16.
    assert torch.equal(x_MD.grad, grad_MD.to(torch.bfloat16).float())
