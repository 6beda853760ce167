"""LocalAdamW is torch's fused AdamW (same update, state and state_dict), it accepts a group mixing
DTensor and plain parameters without a single DTensor dispatch in its step, and it refuses a
gradient placed unlike its parameter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.distributed.local_adamw import LocalAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((4, 6, 5), (7, 3), (3,))]


def _groups(params: list[nn.Parameter]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def _train(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: int = 4) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_equals_torch_fused_adamw_and_its_state_dict():
    ours, ref = _params(), _params()
    opt, ref_opt = LocalAdamW(_groups(ours), **HYPER), torch.optim.AdamW(_groups(ref), fused=True, **HYPER)
    _train(opt, ours)
    _train(ref_opt, ref)
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p, q)
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, state in want["state"].items():
        assert sorted(got["state"][i]) == sorted(state)
        for key, value in state.items():
            assert got["state"][i][key].dtype == value.dtype
            assert torch.equal(got["state"][i][key], value)


def test_same_update_as_the_per_tensor_adamw():
    ours, ref = _params(), _params()
    _train(LocalAdamW(_groups(ours), **HYPER), ours)
    _train(torch.optim.AdamW(_groups(ref), foreach=False, **HYPER), ref)
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_resumes_from_a_per_tensor_adamw_state():
    """A state saved by torch's per-tensor AdamW (its step count on the CPU) continues exactly as
    torch's own AdamW continues it."""
    first, ref = _params(), _params()
    old = torch.optim.AdamW(_groups(first), foreach=False, **HYPER)
    _train(old, first, steps=2)
    with torch.no_grad():
        for p, q in zip(ref, first, strict=True):
            p.copy_(q)
    opt = LocalAdamW(_groups(first), **HYPER)
    opt.load_state_dict(copy.deepcopy(old.state_dict()))  # loading keeps the tensors it is given
    ref_opt = torch.optim.AdamW(_groups(ref), fused=True, **HYPER)
    ref_opt.load_state_dict(copy.deepcopy(old.state_dict()))
    for group in ref_opt.param_groups:  # the loaded groups carry the old run's per-tensor flags
        group.update(fused=True, foreach=None)
    _train(opt, first)
    _train(ref_opt, ref)
    for p, q in zip(first, ref, strict=True):
        assert torch.equal(p, q)
    assert all(s["step"].item() == 6 for s in opt.state.values())


class _DTensorOps(TorchDispatchMode):
    """The ATen operations called with a DTensor argument (a mode sees them before DTensor does)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in pytree.tree_leaves((args, kwargs))):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_group_mixing_dtensors_steps_without_dtensor_dispatch(ep_mesh):
    plain, ref = _params(), _params()
    mixed = [nn.Parameter(distribute_tensor(p.detach().clone(), ep_mesh, [Shard(0)])) if i == 0 else p
             for i, p in enumerate(plain)]
    opt = LocalAdamW(_groups(mixed), **HYPER)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) for p in ref] for _ in range(3)]
    for step, step_grads in enumerate(grads):
        for p, grad in zip(mixed, step_grads, strict=True):
            p.grad = distribute_tensor(grad, ep_mesh, [Shard(0)]) if isinstance(p, DTensor) else grad
        with _DTensorOps() as seen:
            opt.step()
        # The first step creates the DTensor moments; no step touches a DTensor otherwise.
        assert seen.ops == (["aten.zeros_like.default"] * 2 if step == 0 else [])
    ref_opt = torch.optim.AdamW(_groups(ref), fused=True, **HYPER)
    for step_grads in grads:
        for p, grad in zip(ref, step_grads, strict=True):
            p.grad = grad
        ref_opt.step()
    assert isinstance(opt.state[mixed[0]]["exp_avg"], DTensor)
    for p, q in zip(mixed, ref, strict=True):
        assert torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, q)


def test_refuses_a_gradient_placed_unlike_its_parameter(ep_mesh):
    p = nn.Parameter(distribute_tensor(torch.ones(4, 2), ep_mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.ones(4, 2), ep_mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"gradient placed as \(Replicate\(\),\) for a parameter placed as "
                                         r"\(Shard\(dim=0\),\)"):
        LocalAdamW([p], **HYPER).step()
