"""1-bit Adam's frozen variance: a resume keeps the b2 it froze under, and the freeze names the
coordinates its momentum mask holds still.

The averaging is a one-replica stand-in (tests/helpers/onebit.py)."""

import logging

import pytest
import torch

from moetrain.config.optim import OptimConfig
from moetrain.distributed.data_parallel.onebit_adam import OneBitAdam
from moetrain.train.optim import apply_optim_config, build_scheduler
from tests.helpers.onebit import OneReplica

LR = 1e-3


def _trained(warmup: int, steps: int, grad: torch.Tensor):
    w = torch.nn.Parameter(torch.zeros_like(grad))
    opt = OneBitAdam([{"params": [w], "weight_decay": 0.0, "name": "decay"}], data_parallel=OneReplica(),
                     warmup_steps=warmup, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sch = build_scheduler(opt, lr=LR, min_lr=LR, warmup_steps=0, total_steps=1000, schedule="constant")
    for _ in range(steps):
        w.grad = grad.clone()
        opt.step()
        sch.step()
    return w, opt, sch


def _next_step(w, opt, grad: torch.Tensor) -> torch.Tensor:
    before = w.detach().clone()
    w.grad = grad.clone()
    opt.step()
    return (before - w.detach()) / LR


@pytest.mark.parametrize("warmup", [2, 50])
def test_resume_past_the_freeze_keeps_the_saved_b2(warmup):
    ones = torch.ones(4)
    w, opt, sch = _trained(warmup, warmup + 5, ones)
    lines = apply_optim_config(opt, sch, OptimConfig(lr=LR, warmup_steps=0, weight_decay=0.0, betas=(0.9, 0.999),
                                                     schedule="constant"))
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert any("optim.betas[1]: 0.95 in the checkpoint, 0.999 asked, kept" in line for line in lines)
    # A steady gradient: AdamW steps by lr whatever b2 is; a b2 that the frozen variance was not
    # accumulated under would divide it by the wrong bias correction (0.14 lr at warmup 2).
    torch.testing.assert_close(_next_step(w, opt, ones), ones, rtol=1e-4, atol=0)


def test_resume_in_the_warmup_takes_the_new_b2():
    w, opt, sch = _trained(10, 3, torch.ones(4))
    lines = apply_optim_config(opt, sch, OptimConfig(lr=LR, warmup_steps=0, weight_decay=0.0, betas=(0.9, 0.999),
                                                     schedule="constant"))
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert any(line.startswith("optim.betas: (0.9, 0.95) in the checkpoint, (0.9, 0.999) now") for line in lines)


def test_the_freeze_warns_about_coordinates_without_gradient(caplog):
    grad = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0])  # three coordinates never get a gradient in the warmup
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        w, opt, _ = _trained(3, 3, grad)
    assert "3 of 5 replicated coordinates (in 1 tensors) had no gradient during the 3 warmup steps" in caplog.text
    # The mask holds them still, gradient or not, as the warning says.
    step = _next_step(w, opt, torch.ones(5))
    assert step[[1, 3, 4]].eq(0).all() and step[[0, 2]].ne(0).all()


def test_no_warning_when_every_coordinate_had_a_gradient(caplog):
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        _trained(3, 5, torch.ones(4))
    assert "had no gradient during the" not in caplog.text


@pytest.mark.parametrize("new_warmup", [5, 10, 12, 100])
def test_a_resume_with_another_warmup_keeps_the_correction_the_variance_froze_under(new_warmup):
    """The variance froze after 10 steps; the resumed run's warmup (dp.onebit_warmup_steps, or 20%
    of train.steps by default) may differ: a steady gradient still steps by lr, and the run stays
    compressing (the frozen step is saved in the param groups)."""
    ones = torch.ones(4)
    w, opt, _ = _trained(10, 12, ones)
    assert opt.param_groups[0]["onebit_frozen_at"] == 10
    state = opt.state_dict()
    w2 = torch.nn.Parameter(w.detach().clone())
    resumed = OneBitAdam([{"params": [w2], "weight_decay": 0.0, "name": "decay"}], data_parallel=OneReplica(),
                         warmup_steps=new_warmup, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    resumed.load_state_dict(state)
    assert resumed.compressing and resumed.param_groups[0]["onebit_frozen_at"] == 10
    torch.testing.assert_close(_next_step(w2, resumed, ones), ones, rtol=1e-4, atol=0)


def test_masked_coordinates_get_weight_decay_only():
    w = torch.nn.Parameter(torch.ones(3))
    opt = OneBitAdam([{"params": [w], "weight_decay": 0.1, "name": "decay"}], data_parallel=OneReplica(),
                     warmup_steps=2, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(2):
        w.grad = torch.tensor([1.0, 0.0, 0.0])
        opt.step()
    before = w.detach().clone()
    w.grad = torch.ones(3)
    opt.step()
    torch.testing.assert_close(w.detach()[1:], before[1:] * (1 - 1e-2 * 0.1), rtol=0, atol=0)


def test_another_optimizer_drops_the_freeze_step_of_a_one_bit_checkpoint(tmp_path):
    """1-bit Adam -> a resume with plain AdamW -> 1-bit Adam again: AdamW's checkpoint must not
    carry the first stage's freeze step (its variance kept moving), so the second 1-bit stage
    freezes at its own resumed step and steps by lr; with a longer warmup it is not compressing."""
    from moetrain.train.checkpoint.state import load_checkpoint, save_checkpoint

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1, bias=False)

    def onebit(m, warmup):
        return OneBitAdam([{"params": list(m.parameters()), "weight_decay": 0.0}], data_parallel=OneReplica(),
                          warmup_steps=warmup, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def run(m, opt, n):
        for _ in range(n):
            m.weight.grad = torch.ones_like(m.weight)
            opt.step()

    m = model()
    o = onebit(m, 2)
    run(m, o, 5)
    first = save_checkpoint(tmp_path / "ck", 5, model=m, optimizer=o, trainer_state={"step": 5})
    m = model()
    o = torch.optim.AdamW([{"params": list(m.parameters()), "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    load_checkpoint(first, model=m, optimizer=o)
    assert "onebit_frozen_at" not in o.param_groups[0]
    run(m, o, 20)
    second = save_checkpoint(tmp_path / "ck", 25, model=m, optimizer=o, trainer_state={"step": 25})
    m = model()
    o = onebit(m, 2)
    load_checkpoint(second, model=m, optimizer=o)
    assert o.param_groups[0]["onebit_frozen_at"] == 25
    # About lr (the first stage's three frozen steps left v a little off AdamW's): the stale freeze
    # step 2 would divide by 1 - b2^2 and step 0.3 lr.
    torch.testing.assert_close(_next_step(m.weight, o, torch.ones(1, 4)), torch.ones(1, 4), rtol=0.05, atol=0)
    m = model()
    o = onebit(m, 1000)
    load_checkpoint(second, model=m, optimizer=o)
    assert not o.compressing
