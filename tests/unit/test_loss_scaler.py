import pytest
import torch

from moetrain.train.precision import DynamicLossScaler


def _param(grad):
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad)
    return p


def test_finite_gradients_are_unscaled_and_the_step_is_taken():
    s = DynamicLossScaler(enabled=True, init_scale=8.0, growth_interval=2)
    p = _param([8.0, -16.0])
    assert s.scale_loss(torch.tensor(3.0)).item() == 24.0
    assert s.unscale_and_check([p]) is True
    assert p.grad.tolist() == [1.0, -2.0]
    s.update(True)
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 16.0  # doubled after growth_interval good steps


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_gradient_skips_and_halves_the_scale(bad):
    s = DynamicLossScaler(enabled=True, init_scale=2.0**16)
    assert s.unscale_and_check([_param([1.0]), _param([bad, 0.0])]) is False
    s.update(False)
    assert s.scale == 2.0**15


def test_disabled_scaler_is_the_identity():
    s = DynamicLossScaler(enabled=False)
    p = _param([float("inf")])
    assert s.scale_loss(torch.tensor(2.0)).item() == 2.0
    assert s.unscale_and_check([p]) is True  # bf16/fp32 runs: non-finite handling is the trainer's
    assert s.scale == 1.0


def test_state_round_trip():
    s = DynamicLossScaler(enabled=True, init_scale=1024.0)
    s.update(True)
    t = DynamicLossScaler(enabled=True)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
