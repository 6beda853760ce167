"""The expert GEMMs on CUDA: the grouped path (``torch._grouped_mm``, CUTLASS in bf16 on sm90)
against its oracle, the per-expert loop on the same device, and both against the fp32 reference
(tests/helpers/moe_reference.py, run on the CPU) on routing, drops, outputs and every gradient.
The dtypes below autograd are recorded (``DtypeRecorder``): the grouped kernel really ran, in
bf16, forward and backward; the router stayed fp32.

Dims are those of a small real layer (D=64, F=128, E=8, K=2, 64 tokens): the grouped kernel's
16-byte rule holds, and with 8 experts some groups are small and some may be empty.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.distributed.workers.dtype_probe import DtypeRecorder
from tests.unit.test_moe_equivalence import (
    BF16_TOL,
    MODES,
    assert_near,
    assert_same_run,
    inputs,
    make_config,
    make_layers,
    run_layer,
    run_reference,
)

pytestmark = pytest.mark.cuda

DIM, HIDDEN, NUM_EXPERTS, TOKENS = 64, 128, 8, 64
# fp32 on CUDA: the grouped fallback and the loop's matmuls sum in other orders (TF32 is off
# unless train.tf32 asks for it, so a TF32 kernel would show here as ~1e-3).
FP32_TOL = 1e-5


def _on_cpu(run):
    """A ``run_layer`` result moved to the CPU, to compare with the CPU reference."""
    out, aux, x_grad, grads = run
    moved = {f.name: getattr(aux, f.name).cpu() for f in dataclasses.fields(aux)
             if isinstance(getattr(aux, f.name), torch.Tensor)}
    return out.cpu(), dataclasses.replace(aux, **moved), x_grad.cpu(), {n: g.cpu() for n, g in grads.items()}


def _layers(device, dtype, mode: str, *, activation: str = "swiglu", num_shared: int = 1):
    cfg = make_config(num_experts=NUM_EXPERTS, expert_hidden_dim=HIDDEN, activation=activation,
                      num_shared_experts=num_shared, **MODES[mode])
    grouped, loop = make_layers(cfg, DIM)
    return grouped.to(device=device, dtype=dtype), loop.to(device=device, dtype=dtype)


def _recorded_run(layer, x, grad_out):
    recorder = DtypeRecorder()
    handles = recorder.watch(layer)
    with recorder:
        got = run_layer(layer, x, grad_out)
    for h in handles:
        h.remove()
    return got, recorder.seen


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bf16_grouped_gemm_matches_the_loop_oracle_and_the_reference(device, activation, mode):
    grouped, loop = _layers(device, torch.bfloat16, mode, activation=activation)
    x_cpu, grad_cpu = inputs((TOKENS, DIM))
    x, grad_out = x_cpu.bfloat16().to(device), grad_cpu.to(device)
    got, seen = _recorded_run(grouped, x, grad_out)
    oracle = run_layer(loop, x, grad_out)

    # Which kernels ran, in which dtype: the grouped GEMM in bf16 both ways, the router in fp32.
    gemms = [s for s in seen if s.op == "_grouped_mm"]
    assert {s.backward for s in gemms} == {False, True}, "the grouped kernel did not run forward and backward"
    assert all(d == torch.bfloat16 for s in gemms for d in s.dtypes if d.is_floating_point), gemms[:4]
    # (The gate weight itself is bf16 here: the whole layer was cast; the router upcasts it.)
    router = [s for s in seen if s.where in ("router", "router_logits")]
    assert router and all(d == torch.float32 for s in router for d in s.dtypes if d.is_floating_point), router[:4]

    # The oracle on the same device and dtype: the same routing, outputs and gradients.
    out, aux, x_grad, grads = got
    assert out.dtype == torch.bfloat16 and out.device == x.device
    assert aux.num_routed_per_expert.tolist() == oracle[1].num_routed_per_expert.tolist()
    assert int(aux.num_dropped) == int(oracle[1].num_dropped)
    assert_near(out, oracle[0].float(), BF16_TOL, "output vs loop")
    assert_near(x_grad, oracle[2].float(), BF16_TOL, "grad of the input vs loop")
    for name, g in grads.items():
        assert_near(g, oracle[3][name].float(), BF16_TOL, f"grad of {name} vs loop")

    # Both against the fp32 reference on the same bf16 values (on the CPU: it loops in Python).
    ref_run = run_reference(copy.deepcopy(grouped).cpu(), x_cpu.bfloat16(), grad_cpu)
    if mode != "dropless":
        assert ref_run[0].num_dropped > 0, "the capacity case must actually drop copies"
    assert_same_run(_on_cpu(got), ref_run, tol=BF16_TOL)
    assert_same_run(_on_cpu(oracle), ref_run, tol=BF16_TOL)


def test_fp32_grouped_gemm_matches_the_loop_oracle(device):
    grouped, loop = _layers(device, torch.float32, "capacity_score")
    x, grad_out = (t.to(device) for t in inputs((TOKENS, DIM)))
    (out, aux, x_grad, grads), seen = _recorded_run(grouped, x, grad_out)
    assert any(s.op == "_grouped_mm" for s in seen), "impl='grouped' with aligned dims never called the grouped matmul"
    oracle = run_layer(loop, x, grad_out)
    assert int(aux.num_dropped) == int(oracle[1].num_dropped) > 0
    assert_near(out, oracle[0], FP32_TOL, "output vs loop")
    assert_near(x_grad, oracle[2], FP32_TOL, "grad of the input vs loop")
    for name, g in grads.items():
        assert_near(g, oracle[3][name], FP32_TOL, f"grad of {name} vs loop")


def test_bf16_autocast_over_fp32_master_weights(device):
    """Mixed precision as the trainer runs it at ZeRO stages 0/1 on a GPU: fp32 parameters,
    ``torch.autocast("cuda", bf16)``. The experts and the shared expert compute in bf16, the
    router in fp32, and every gradient reaches the fp32 master weights in fp32."""
    grouped, _ = _layers(device, torch.float32, "dropless")
    x, grad_out = (t.to(device) for t in inputs((TOKENS, DIM)))
    recorder = DtypeRecorder()
    handles = recorder.watch(grouped)
    with recorder, torch.autocast(device.type, dtype=torch.bfloat16):
        out, aux = grouped(x.clone().requires_grad_())
        ((out.float() * grad_out).sum() + aux.loss).backward()
    for h in handles:
        h.remove()
    assert out.dtype == torch.bfloat16
    for where, expected in (("gemm", torch.bfloat16), ("shared", torch.bfloat16), ("router", torch.float32),
                            ("router_logits", torch.float32)):
        found = [s for s in recorder.seen if s.where == where]
        assert found, f"no {where} op recorded"
        wrong = [s for s in found if any(d.is_floating_point and d != expected for d in s.dtypes)]
        assert not wrong, f"{where} not in {expected}: {wrong[:4]}"
    assert {s.backward for s in recorder.seen if s.op == "_grouped_mm"} == {False, True}
    for name, p in grouped.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
