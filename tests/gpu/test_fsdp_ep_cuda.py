"""ZeRO-3 (FSDP2) with the expert-parallel all-to-all dispatcher on one GPU over NCCL.

World 1 is ``parallel.ep = 1``, so no rank holds a slice of the experts; what the CPU cannot run
still runs here: FSDP2 gathers and reduce-scatters every unit on CUDA over NCCL (with the bf16
parameter policy and the routers' fp32 units), and every MoE layer's tokens travel through the
all-to-all dispatcher over the NCCL ep group (swapped in after ``parallelize``, which would keep
the local dispatcher at ep = 1). The model and data are the ZeRO harness's
(tests/distributed/workers/zero_parity.py).

* fp32: the losses of every step and the gradients of the first equal one plain process on the
  same GPU (only CUDA's atomic summation order differs; parameters are not compared, since AdamW
  turns a last-bit difference in a near-zero gradient into an O(lr) step);
* bf16: the dtypes below autograd follow the rules of tests/distributed/test_precision_dtypes.py
  (bf16 expert GEMMs and token rows, fp32 router, fp32 master weights, gradients and states).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.distributed import AllToAllDispatcher, ParallelDims, parallelize
from moetrain.train.optim import build_optimizer
from moetrain.train.precision import autocast_context
from tests.distributed.workers.dtype_probe import (
    DtypeRecorder,
    check_recorded_dtypes,
    moe_layers,
    state_dtypes,
)
from tests.distributed.workers.zero_parity import Run, build, make_batches, model_configs

pytestmark = pytest.mark.cuda


def _optimizer(model):
    return build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _zero_with_all_to_all(run: Run, device: torch.device):
    """(model, optimizer): ``run`` at its ZeRO stage on a one-rank NCCL mesh, every MoE layer
    dispatching through the all-to-all dispatcher over the ep group."""
    dims = ParallelDims(world_size=1, num_experts=model_configs(run)[1].num_experts)
    dims.build_mesh(device.type)
    model = build(run).to(device)
    parallelize(model, dims, zero_stage=run.zero_stage, mixed_precision=run.dtype)
    for layer in moe_layers(model):
        c = layer.config
        layer.dispatcher = AllToAllDispatcher(c.num_experts, ep_group=dims.group("ep"), dedup=c.dispatch_dedup,
                                              dispatch_dtype=c.dispatch_dtype)
    return model, _optimizer(model)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model, optimizer, run: Run, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``run.steps`` steps on the whole global batch; (losses, gradients of the first step)."""
    losses, first_grads = [], {}
    for step, tokens in enumerate(make_batches(run, run.steps).to(device)):
        with autocast_context(device, run.dtype):
            out = model(tokens[:, :-1], tokens[:, 1:])
        out.total_loss.backward()
        losses.append(out.loss.item())
        if step == 0:
            first_grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, first_grads


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_fp32_zero_step_with_the_all_to_all_dispatcher_equals_one_plain_process(device, nccl_world, zero_stage):
    run = Run(f"fp32_stage{zero_stage}", zero_stage, steps=4, moe={"num_shared_experts": 1})
    model, optimizer = _zero_with_all_to_all(run, device)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not shard every parameter"
    losses, grads = _train(model, optimizer, run, device)

    plain = build(run).to(device)
    want_losses, want_grads = _train(plain, _optimizer(plain), run, device)
    assert losses[0] == pytest.approx(want_losses[0], rel=1e-5)
    assert losses == pytest.approx(want_losses, rel=1e-4), list(zip(want_losses, losses, strict=True))
    assert losses[-1] < losses[0], losses
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"first-step grad of {n}: {m}")


@pytest.mark.parametrize("dedup", [False, True], ids=["per_copy", "dedup"])
def test_bf16_zero3_dtypes_on_cuda(device, nccl_world, dedup):
    run = Run("bf16_stage3" + ("_dedup" if dedup else ""), 3, dtype="bf16", steps=1,
              moe={"num_shared_experts": 1, "dispatch_dedup": dedup})
    model, optimizer = _zero_with_all_to_all(run, device)
    tokens = make_batches(run, 1)[0].to(device)
    recorder = DtypeRecorder()
    handles = [h for layer in moe_layers(model) for h in recorder.watch(layer)]
    with recorder:
        with autocast_context(device, run.dtype):
            out = model(tokens[:, :-1], tokens[:, 1:])
        out.total_loss.backward()
    for h in handles:
        h.remove()
    before = state_dtypes(model, optimizer)
    optimizer.step()
    after = state_dtypes(model, optimizer)
    res = {"seen": recorder.seen, "params": after["params"], "grads": before["grads"],
           "optimizer_states": after["optimizer_states"]}
    check_recorded_dtypes(run, res, f"[{run.name}] cuda")
    # The bf16 step computes the same loss as fp32 to bf16's precision (a few 1e-3 on ~4.2).
    plain = build(run).to(device)
    with torch.no_grad():
        want = plain(tokens[:, :-1], tokens[:, 1:]).loss.item()
    assert out.loss.item() == pytest.approx(want, rel=2e-2)
