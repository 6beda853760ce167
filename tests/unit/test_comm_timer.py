"""The collective timer (``moetrain.distributed.comm.timer``) on host clocks."""

import time

import torch

from moetrain.distributed.comm.timer import CommTimer, timed_exchange


class _Slow(torch.autograd.Function):
    """Stands in for an exchange: identity that sleeps in both directions."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad * 3.0, None, None


def test_forward_and_backward_spans_measure_the_exchange_only():
    timer = CommTimer(enabled=True)
    x = torch.ones(4, requires_grad=True)
    h = x * 2.0
    time.sleep(0.3)  # outside any span
    y = timed_exchange(lambda t: _Slow.apply(t, 0.03, 0.12), h, timer, kind="dispatch")
    z = _Slow.apply(y, 0.0, 0.3)  # after the exchange: its backward sleeps before the span starts
    (z * 5.0).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 90.0))  # the marks are identities
    seconds = timer.read()
    assert 0.03 <= seconds["comm_time/dispatch"] < 0.3
    assert 0.12 <= seconds["comm_time/dispatch_backward"] < 0.3
    assert seconds["comm_calls/dispatch"] == 1 and seconds["comm_calls/dispatch_backward"] == 1
    assert timer.read() == {}  # reset by the read


def test_disabled_timer_adds_no_autograd_nodes_and_records_nothing():
    timer = CommTimer(enabled=False)
    x = torch.ones(3, requires_grad=True)
    y = timed_exchange(lambda t: t * 2.0, x, timer, kind="combine")
    assert type(y.grad_fn).__name__ == "MulBackward0"
    y.sum().backward()
    assert timer.read() == {}


def test_nested_spans_of_one_kind_each_count():
    timer = CommTimer(enabled=True)
    timer.start("combine_backward")
    timer.start("combine_backward")
    time.sleep(0.02)
    timer.stop("combine_backward")
    timer.stop("combine_backward")
    out = timer.read()
    assert out["comm_calls/combine_backward"] == 2 and out["comm_time/combine_backward"] >= 0.04


def test_no_backward_span_without_gradients():
    timer = CommTimer(enabled=True)
    with torch.no_grad():
        timed_exchange(lambda t: t + 1, torch.ones(2, requires_grad=True), timer, kind="dispatch")
    assert set(timer.read()) == {"comm_time/dispatch", "comm_calls/dispatch"}
