"""The CPU expert-GEMM kernel (whole experts per thread) against a plain per-expert loop of
``torch.mm`` with autograd: outputs and the gradients of the input and the weights, for the row
patterns its thread plan treats differently (balanced, empty experts, one expert with most rows,
a single expert, many experts), plus its input checks and the switch that turns it off."""

import os
import subprocess
import sys

import pytest
import torch

from moetrain.models.moe import cpu_experts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    assert cpu_experts.kernel() is not None, "the extension must build here (ninja and a C++ compiler)"
    yield
    torch.set_num_threads(old)


def loop_reference(x_MI, w_EIO, sizes):
    return torch.cat([x @ w for x, w in zip(x_MI.split(sizes), w_EIO.unbind(0))])


def run(fn, x_MI, w_EIO, sizes, grad_MO):
    x = x_MI.detach().clone().requires_grad_()
    w = w_EIO.detach().clone().requires_grad_()
    y = fn(x, w, sizes)
    y.backward(grad_MO)
    return y.detach(), x.grad, w.grad


PATTERNS = {
    "balanced": [40, 37, 45, 38],
    "empty_experts": [0, 29, 0, 51, 3, 0],
    "one_expert_has_most": [2, 90, 1, 3],  # more than a thread's share: runs alone, all threads
    "single_expert": [64],
    "many_experts": [int(n) for n in torch.randint(0, 20, (33,), generator=torch.Generator().manual_seed(0))],
    "no_rows": [0, 0, 0],
}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_a_per_expert_loop_fp32(pattern):
    sizes = PATTERNS[pattern]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 24, generator=g)
    w = torch.randn(len(sizes), 24, 40, generator=g) / 5
    grad = torch.randn(sum(sizes), 40, generator=g)
    got = run(cpu_experts.grouped_mm, x, w, sizes, grad)
    want = run(loop_reference, x, w, sizes, grad)
    for name, a, b in zip(("out", "grad_x", "grad_w"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # Experts without rows get an exactly zero weight gradient.
    for e, n in enumerate(sizes):
        if n == 0:
            assert torch.count_nonzero(got[2][e]) == 0


def test_matches_a_per_expert_loop_bf16():
    sizes = [7, 0, 12, 5]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(sizes), 16, generator=g).bfloat16()
    w = (torch.randn(len(sizes), 16, 8, generator=g) / 4).bfloat16()
    grad = torch.randn(sum(sizes), 8, generator=g).bfloat16()
    got = run(cpu_experts.grouped_mm, x, w, sizes, grad)
    want = run(loop_reference, x, w, sizes, grad)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_strided_weights_are_read_as_they_are():
    # The backward passes w transposed (a view); the forward must take such weights too.
    sizes = [9, 14]
    x = torch.randn(23, 12)
    w_EOI = torch.randn(2, 20, 12)
    got = cpu_experts.grouped_mm(x, w_EOI.transpose(1, 2), sizes)
    torch.testing.assert_close(got, loop_reference(x, w_EOI.transpose(1, 2), sizes))


def test_row_counts_that_do_not_add_up_are_refused():
    with pytest.raises(RuntimeError, match=r"the expert row counts add up to 9, the input has 10 rows"):
        cpu_experts.grouped_mm(torch.randn(10, 4), torch.randn(2, 4, 4), [4, 5])
    with pytest.raises(RuntimeError, match=r"weights .* do not match the input"):
        cpu_experts.grouped_mm(torch.randn(9, 4), torch.randn(3, 4, 4), [4, 5])


def test_one_thread_or_the_switch_keeps_torch_grouped_mm():
    x = torch.randn(8, 16)
    torch.set_num_threads(1)
    assert not cpu_experts.usable(x)
    torch.set_num_threads(2)
    assert cpu_experts.usable(x)
    with cpu_experts.disabled():
        assert not cpu_experts.usable(x)
    assert cpu_experts.usable(x)
    # A fresh process with the switch off: no build, and the layer still matches its loop oracle.
    code = (
        "import torch; torch.set_num_threads(2)\n"
        "from moetrain.models.moe import cpu_experts, GroupedExperts\n"
        "assert cpu_experts.kernel() is None and not cpu_experts.usable(torch.randn(4, 16))\n"
        "torch.manual_seed(0)\n"
        "ex = GroupedExperts(16, 32, 4); loop = GroupedExperts(16, 32, 4, impl='loop')\n"
        "loop.load_state_dict(ex.state_dict())\n"
        "x = torch.randn(20, 16); n = torch.tensor([5, 0, 9, 6])\n"
        "torch.testing.assert_close(ex(x, n), loop(x, n))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "MOETRAIN_CPU_EXPERT_KERNEL": "0", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
