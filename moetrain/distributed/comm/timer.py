"""Time spent in collectives, per kind, for the metrics (``log.comm_timing``).

A collective that overlaps compute has no time of its own until somebody waits for it, so timing
means waiting: with a timer enabled, every timed collective is waited for inside its span.
Communication then no longer overlaps compute (throughput drops a little, or a lot where overlap
hid it), and each span measures what that kind of exchange costs on this layout: the most that
overlap could hide. Off by default; the byte counters are always on.

Spans are host clocks on CPU and CUDA events on the current stream on a GPU (recorded without a
host sync; ``read`` synchronises once, at the log step). A differentiable exchange is timed in
both directions by ``timed_exchange``: its forward span, and the span between the backward
reaching its output and leaving its input.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor


class CommTimer:
    """Seconds per kind of collective since the last ``read``; a no-op unless ``enabled``."""

    def __init__(self, *, enabled: bool = False, device: torch.device | None = None) -> None:
        self.enabled = enabled
        self._cuda = device is not None and device.type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[str, list[torch.cuda.Event | float]] = defaultdict(list)

    def start(self, kind: str) -> None:
        if not self.enabled:
            return
        # A stack per kind: the backward spans of chunked exchanges may nest.
        self._open[kind].append(self._mark())

    def stop(self, kind: str) -> None:
        if not self.enabled:
            return
        begin, end = self._open[kind].pop(), self._mark()
        self._counts[kind] += 1
        # Both marks are of the one kind _mark makes for this timer's device.
        if isinstance(begin, float):
            assert isinstance(end, float)
            self._seconds[kind] += end - begin
        else:
            assert isinstance(end, torch.cuda.Event)
            self._events.append((kind, begin, end))

    @contextlib.contextmanager
    def span(self, kind: str):
        """Time the block as one collective of ``kind``; the block must wait for its result."""
        self.start(kind)
        try:
            yield
        finally:
            self.stop(kind)

    def read(self, *, reset: bool = True) -> dict[str, float]:
        """``{"comm_time/<kind>": seconds, "comm_calls/<kind>": spans}`` since the last read."""
        if self._events:
            self._events[-1][2].synchronize()
            for kind, begin, end in self._events:
                self._seconds[kind] += begin.elapsed_time(end) / 1000.0
            self._events = []
        out = {f"comm_time/{k}": v for k, v in sorted(self._seconds.items())}
        out.update({f"comm_calls/{k}": float(n) for k, n in sorted(self._counts.items())})
        if reset:
            self._seconds.clear()
            self._counts.clear()
        return out

    def _mark(self) -> torch.cuda.Event | float:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()


def waited(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its collective finished (functional collectives return before they finish)."""
    return x.wait() if isinstance(x, AsyncCollectiveTensor) else x


class _BackwardMark(torch.autograd.Function):
    """Identity in the forward. Its backward starts the backward span (placed on the exchange's
    output: the gradient reaches it first) or ends it (on the input, once the gradient is here)."""

    @staticmethod
    def forward(ctx, x, timer: CommTimer, kind: str, starts: bool):
        ctx.timer, ctx.kind, ctx.starts = timer, kind, starts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.starts:
            ctx.timer.start(ctx.kind)
        else:
            grad = waited(grad)
            ctx.timer.stop(ctx.kind)
        return grad, None, None, None


def timed_exchange(exchange, x: torch.Tensor, timer: CommTimer, *, kind: str,
                   backward_kind: str | None = None) -> torch.Tensor:
    """``exchange(x)`` timed as ``kind`` in the forward and ``backward_kind`` (default: ``kind``
    + "_backward") in the backward. Untouched when the timer is off."""
    if not timer.enabled:
        return exchange(x)
    backward_kind = backward_kind or f"{kind}_backward"
    track_backward = x.requires_grad and torch.is_grad_enabled()
    if track_backward:
        x = _BackwardMark.apply(x, timer, backward_kind, False)
    with timer.span(kind):
        y = waited(exchange(x))
    if track_backward and y.requires_grad:
        y = _BackwardMark.apply(y, timer, backward_kind, True)
    return y
