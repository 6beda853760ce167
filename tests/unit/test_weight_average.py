"""``WeightAverage`` (optim.ema_decay): the average against a float64 recurrence written out here,
what it covers (trainable parameters, once per tied weight), and that applying it for a block leaves
the raw weights bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.config.optim import OptimConfig
from moetrain.train.weight_average import WeightAverage


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # one tensor under two names
        self.norm = nn.LayerNorm(3)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        self.register_buffer("bias_E", torch.zeros(4))


def test_average_follows_the_warmed_up_recurrence():
    torch.manual_seed(0)
    model, decay = nn.Linear(4, 3), 0.9
    start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ema = WeightAverage(model, decay=decay)
    want = dict(start)
    for t in range(100):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = min(decay, (1 + t) / (10 + t))  # 0.1, 0.18, ..., capped at 0.9 from t = 80
        assert ema.next_decay() == pytest.approx(d, rel=1e-12)
        ema.update()
        want = {n: d * want[n] + (1 - d) * p.detach().double() for n, p in model.named_parameters()}
    assert ema.num_updates == 100 and ema.next_decay() == decay
    got = ema.state_dict()
    assert sorted(got) == ["bias", "weight"]
    for name, w in want.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name].double(), w, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(got[name].double(), start[name])  # it moved


def test_covers_each_trainable_weight_once_under_every_name():
    model = Tied()
    ema = WeightAverage(model, decay=0.5)
    sd = ema.state_dict()
    assert sorted(sd) == ["embed.weight", "head.weight", "norm.bias", "norm.weight"]  # no frozen, no buffer
    assert sd["embed.weight"] is sd["head.weight"]
    assert sd["embed.weight"] is not model.embed.weight
    assert torch.equal(sd["embed.weight"], model.embed.weight)


def test_applied_swaps_in_the_average_and_restores_the_raw_weights_exactly():
    torch.manual_seed(1)
    model = Tied()
    ema = WeightAverage(model, decay=0.99)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3).add_(0.25)
    raw = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema.update()
    x = torch.tensor([[0, 2, 4]])
    with ema.applied():
        for name, avg in ema.state_dict().items():
            assert torch.equal(model.get_parameter(name), avg), name
        inside = model.head(model.norm(model.embed(x)))
    for name, p in model.named_parameters():
        assert torch.equal(p, raw[name]), name
    assert not torch.equal(inside, model.head(model.norm(model.embed(x))))


def test_state_round_trip_and_restart():
    torch.manual_seed(2)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    ema_a, ema_b = WeightAverage(a, decay=0.9), WeightAverage(b, decay=0.9)
    for _ in range(3):
        with torch.no_grad():
            a.weight.add_(1.0)
        ema_a.update()
    ema_b.load_state_dict(ema_a.state_dict(), num_updates=ema_a.num_updates)
    assert ema_b.num_updates == 3 and ema_b.next_decay() == ema_a.next_decay()
    for name, t in ema_a.state_dict().items():
        assert torch.equal(ema_b.state_dict()[name], t)
    ema_b.restart()
    assert ema_b.num_updates == 0 and torch.equal(ema_b.state_dict()["weight"], b.weight)
    with pytest.raises(ValueError, match="lacks 1 weights: bias"):
        ema_b.load_state_dict({"weight": a.weight}, num_updates=0)


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.9"])
def test_decay_outside_the_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"optim\.ema_decay .* must be in \[0, 1\)"):
        OptimConfig(ema_decay=bad)


def test_memory_accounting_counts_the_average_once_as_optimizer_memory():
    """The trainer's mem/* metrics (MemoryTracker) and model_state_bytes add the average's bytes to
    the optimizer's, exactly: one copy per distinct trainable weight (the tied one once)."""
    from copy import deepcopy

    from moetrain.utils.memory import MemoryTracker, model_state_bytes

    torch.manual_seed(0)
    base = Tied()
    avg_bytes = (5 * 3 + 3 + 3) * 4  # the embedding (= the head), the norm's weight and bias

    def step(with_average: bool):
        model = deepcopy(base)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        ema = WeightAverage(model, decay=0.9)
        states = ema.tensors() if with_average else ()
        with MemoryTracker(model, opt, states) as tracker:
            model.head(model.norm(model.embed(torch.tensor([0, 3, 4])))).square().sum().backward()
            opt.step()
            ema.update()
        return tracker.report(), model_state_bytes(model, opt, states)

    (plain, plain_states), (averaged, averaged_states) = step(False), step(True)
    assert averaged.optim_bytes - plain.optim_bytes == avg_bytes
    assert averaged.peak_bytes - plain.peak_bytes == avg_bytes
    assert (averaged.param_bytes, averaged.grad_bytes, averaged.activation_peak_bytes) == (
        plain.param_bytes, plain.grad_bytes, plain.activation_peak_bytes)
    assert averaged_states["optim_bytes"] - plain_states["optim_bytes"] == avg_bytes
    assert sum(t.nbytes for t in WeightAverage(base, decay=0.9).tensors()) == avg_bytes
