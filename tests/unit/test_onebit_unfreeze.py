"""1-bit Adam's coordinates that had no gradient in the whole warmup (an expert that got no token,
an embedding row not yet seen) have a frozen v of 0. They train once compression starts: their v is
set once from the averaged momentum (v_hat = g^2, g = m / (1 - b1)), where a v > 0 momentum mask
used to freeze them for good. The data-parallel side is a stand-in with one replica (the momentum
average is the identity), so the expected weights follow by hand."""

from __future__ import annotations

import torch

from moetrain.distributed.data_parallel.onebit_adam import OneBitAdam

WARMUP, STEPS, LR, B1, B2, EPS = 3, 8, 1e-2, 0.9, 0.95, 1e-8


class _OneReplica:
    local_gradients = False

    def has_replicas(self, p) -> bool:
        return True

    def set_local_gradients(self, on: bool) -> None:
        self.local_gradients = on

    def onebit_average_(self, params, tensors) -> None:
        pass


def _grad(step: int) -> torch.Tensor:
    """Row 0 trains throughout; row 1 gets its first gradient after the warmup; row 2 never does."""
    g = torch.ones(3, 4)
    g[2] = 0.0
    if step <= WARMUP:
        g[1] = 0.0
    return g


def test_a_row_without_gradient_in_the_warmup_trains_after_it():
    w = torch.nn.Parameter(torch.zeros(3, 4))
    opt = OneBitAdam([{"params": [w], "weight_decay": 0.0}], data_parallel=_OneReplica(),  # type: ignore[arg-type]
                     warmup_steps=WARMUP, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0)
    got = []
    for step in range(1, STEPS + 1):
        w.grad = _grad(step)
        opt.step()
        got.append(w.detach().clone())
    # By hand, in float64. Row 0: a steady gradient of 1, so m_hat = v_hat = 1 and every step is lr.
    # Row 1: m = 1 - b1^(t - WARMUP) from its first gradient; v set at step WARMUP + 1 to
    # v_hat = (m / (1 - b1))^2 = 1, then frozen.
    row0 = row1 = 0.0
    for step in range(1, STEPS + 1):
        row0 -= LR * 1.0 / (1.0 + EPS)
        if step > WARMUP:
            m = 1 - B1 ** (step - WARMUP)
            row1 -= LR * m / (1 - B1 ** step) / (1.0 + EPS)
        want = torch.tensor([[row0] * 4, [row1] * 4, [0.0] * 4])
        torch.testing.assert_close(got[step - 1].double(), want.double(), rtol=1e-5, atol=1e-9)
    assert got[-1][1, 0] < got[WARMUP][1, 0] < 0  # row 1 moves, each compressed step
    v = opt.state[w]["exp_avg_sq"]
    torch.testing.assert_close(v[1], torch.full((4,), 1 - B2 ** WARMUP))  # v_hat = 1 after the fill
    assert torch.equal(v[2], torch.zeros(4)) and torch.equal(got[-1][2], torch.zeros(4))  # no m: no move


def test_the_fill_happens_once_and_then_v_stays_frozen():
    w = torch.nn.Parameter(torch.zeros(3, 4))
    opt = OneBitAdam([{"params": [w], "weight_decay": 0.0}], data_parallel=_OneReplica(),  # type: ignore[arg-type]
                     warmup_steps=WARMUP, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0)
    seen = []
    for step in range(1, STEPS + 1):
        w.grad = _grad(step) * (3.0 if step > WARMUP + 1 else 1.0)  # a larger gradient later
        opt.step()
        seen.append(opt.state[w]["exp_avg_sq"].clone())
    for v in seen[WARMUP + 1:]:
        assert torch.equal(v, seen[WARMUP])
