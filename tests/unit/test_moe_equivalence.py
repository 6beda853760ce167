"""The grouped expert path, the per-expert loop path and the naive reference (moe_reference.py)
agree: outputs, aux losses, routing counts, and the gradients of the input and of every parameter.

Dims are multiples of 8 so torch._grouped_mm's 16-byte stride rule holds and the grouped path
really runs (checked by counting its calls); odd dims check the fallback. bf16 cases are few and
tiny: bf16 matmuls are slow on CPU.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import GroupedExperts, MoELayer
from tests.helpers.moe_reference import reference_experts, reference_moe

DIM, HIDDEN, NUM_EXPERTS, TOP_K = 16, 32, 4, 2
# fp32, three summation orders (grouped GEMM, per-expert loop, dense reference): a gradient element
# sums ~100 products of size ~0.1, and AVX2 and AVX-512 kernels round those sums apart by ~1e-6.
FP32_TOL = {"rtol": 1e-5, "atol": 4e-6}

MODES = {
    "dropless": {"capacity_factor": None},
    # ceil(0.75 * 16 * 2 / 4) = 6 slots for ~8 copies per expert: drops are certain.
    "capacity_position": {"capacity_factor": 0.75, "drop_policy": "position"},
    "capacity_score": {"capacity_factor": 0.75, "drop_policy": "score"},
}


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    """Counts the calls of torch's grouped matmul, to prove the grouped path is not silently
    skipped."""
    calls = []
    for owner, name in [(torch, "_grouped_mm"), (F, "grouped_mm")]:
        fn = getattr(owner, name, None)
        if fn is not None:
            def counted(*args, _fn=fn, **kwargs):
                calls.append(1)
                return _fn(*args, **kwargs)
            monkeypatch.setattr(owner, name, counted)
    return calls


def make_config(**overrides) -> MoEConfig:
    kwargs = {"num_experts": NUM_EXPERTS, "top_k": TOP_K, "expert_hidden_dim": HIDDEN,
              "aux_loss_coef": 0.1, "z_loss_coef": 0.01, "expert_impl": "grouped"}
    return MoEConfig(**{**kwargs, **overrides})


def make_layers(cfg: MoEConfig, dim: int = DIM, *, seed: int = 0) -> tuple[MoELayer, MoELayer]:
    """A grouped-path layer and a loop-path copy with the same weights.

    Weights are redrawn at unit scale (1/sqrt(fan_in)) and the router made decisive, so outputs are
    O(1), the tolerances mean something and no two routing scores are nearly tied.
    """
    torch.manual_seed(seed)
    layer = MoELayer(dim, replace(cfg, expert_impl="grouped"))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "router.gate.weight":
                p.normal_(0.0, 0.5)
            else:  # dim 1 is fan-in both for experts [E, in, out] and for nn.Linear [out, in]
                p.normal_(0.0, p.shape[1] ** -0.5)
    loop = MoELayer(dim, replace(cfg, expert_impl="loop"))
    loop.load_state_dict(layer.state_dict())
    return layer, loop


def run_layer(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out, aux = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    ((out.float() * grad_out).sum() + aux.loss).backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), aux, x.grad, grads


def run_reference(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor):
    c = layer.config
    params = {name: p.detach().clone().float().requires_grad_() for name, p in layer.named_parameters()}
    x = x.detach().clone().float().requires_grad_()
    ref = reference_moe(x, params, num_experts=c.num_experts, top_k=c.top_k, activation=c.activation,
                        renormalize=c.renormalize, capacity_factor=c.capacity_factor,
                        drop_policy=c.drop_policy, aux_loss_coef=c.aux_loss_coef, z_loss_coef=c.z_loss_coef)
    ((ref.out * grad_out).sum() + ref.aux_loss).backward()
    # Every parameter of the layer must have been used (and so checked) by the reference.
    unused = [name for name, p in params.items() if p.grad is None]
    assert not unused, f"reference ignores layer parameters {unused}"
    return ref, x.grad, {name: p.grad for name, p in params.items()}


def assert_near(actual: torch.Tensor, expected: torch.Tensor, tol, what: str) -> None:
    """``tol``: assert_close kwargs (fp32), or a float bounding ``|a - e| / |e|`` in the 2-norm (bf16,
    where a few elements always stray but the tensor as a whole must stay within ~0.5%)."""
    actual, expected = actual.detach().float(), expected.detach()
    if isinstance(tol, dict):
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")
    else:
        assert actual.shape == expected.shape, what
        err = float((actual - expected).norm() / expected.norm())
        assert err <= tol, f"{what}: relative error {err:.4f} > {tol}"


def assert_same_run(got, ref_run, *, tol):
    out, aux, x_grad, grads = got
    ref, ref_x_grad, ref_grads = ref_run
    assert_near(out, ref.out, tol, "output")
    assert_near(x_grad, ref_x_grad, tol, "grad of the input")
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g is not None, f"no gradient for {name}"
        assert_near(g, ref_grads[name], tol, f"grad of {name}")
    assert aux.num_routed_per_expert.tolist() == ref.num_routed_per_expert
    assert int(aux.num_dropped) == ref.num_dropped
    # The aux losses come from the fp32 router in every precision.
    torch.testing.assert_close(aux.load_balancing, ref.load_balancing, **FP32_TOL)
    torch.testing.assert_close(aux.z_loss, ref.z_loss, **FP32_TOL)
    torch.testing.assert_close(aux.loss, ref.aux_loss, **FP32_TOL)


def inputs(shape, *, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_shared", [0, 1])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_loop_and_reference_agree_fp32(activation, num_shared, mode, grouped_mm_calls):
    cfg = make_config(activation=activation, num_shared_experts=num_shared, **MODES[mode])
    grouped, loop = make_layers(cfg)
    x, grad_out = inputs((2, 8, DIM))  # [B, S, D]: T = 16
    ref_run = run_reference(grouped, x, grad_out)
    if mode != "dropless":
        assert ref_run[0].num_dropped > 0, "the capacity case must actually drop copies"

    assert_same_run(run_layer(grouped, x, grad_out), ref_run, tol=FP32_TOL)
    assert grouped_mm_calls, "impl='grouped' with aligned dims never called the grouped matmul"
    num_grouped_calls = len(grouped_mm_calls)
    assert_same_run(run_layer(loop, x, grad_out), ref_run, tol=FP32_TOL)
    assert len(grouped_mm_calls) == num_grouped_calls, "impl='loop' must not use the grouped matmul"


@pytest.mark.parametrize("top_k, renormalize", [(1, True), (2, False), (3, True)])
def test_other_top_k_and_raw_softmax_weights_agree_with_reference(top_k, renormalize):
    cfg = make_config(top_k=top_k, renormalize=renormalize, **MODES["capacity_score"])
    grouped, loop = make_layers(cfg)
    x, grad_out = inputs((16, DIM))
    ref_run = run_reference(grouped, x, grad_out)
    assert ref_run[0].num_dropped > 0
    for layer in (grouped, loop):
        assert_same_run(run_layer(layer, x, grad_out), ref_run, tol=FP32_TOL)


@pytest.mark.parametrize("dim, hidden", [(7, 16), (8, 6), (13, 11)])
def test_unaligned_dims_fall_back_and_agree_with_reference(dim, hidden):
    # 7 or 13 fp32 values per row (28/52 bytes) or a hidden row of 6 or 11 break the 16-byte rule.
    cfg = make_config(activation="swiglu", expert_hidden_dim=hidden, num_shared_experts=1,
                      capacity_factor=0.75)
    grouped, _ = make_layers(cfg, dim)
    x, grad_out = inputs((16, dim))
    assert_same_run(run_layer(grouped, x, grad_out), run_reference(grouped, x, grad_out), tol=FP32_TOL)


# activation, num_shared_experts, mode
BF16_CASES = [
    ("gelu", 0, "dropless"),
    ("swiglu", 1, "capacity_score"),
]
BF16_TOL = 2e-2  # relative 2-norm error; measured ~0.5% on these cases


@pytest.mark.parametrize("activation, num_shared, mode", BF16_CASES)
def test_bf16_grouped_loop_and_reference_agree(activation, num_shared, mode):
    """Pure bf16 (parameters and activations), against the fp32 reference run on the same bf16 values."""
    cfg = make_config(activation=activation, num_shared_experts=num_shared, **MODES[mode])
    grouped, loop = make_layers(cfg)
    grouped, loop = grouped.to(torch.bfloat16), loop.to(torch.bfloat16)
    x, grad_out = inputs((16, DIM))
    x = x.bfloat16()
    ref_run = run_reference(grouped, x, grad_out)
    got_grouped = run_layer(grouped, x, grad_out)
    assert got_grouped[0].dtype == torch.bfloat16
    assert_same_run(got_grouped, ref_run, tol=BF16_TOL)
    assert_same_run(run_layer(loop, x, grad_out), ref_run, tol=BF16_TOL)


def test_bf16_activations_with_fp32_parameters():
    """Mixed precision as the experts implement it: fp32 master weights, bf16 activations."""
    cfg = make_config(activation="swiglu", **MODES["capacity_position"])
    grouped, loop = make_layers(cfg)
    x, grad_out = inputs((16, DIM))
    x = x.bfloat16()
    ref_run = run_reference(grouped, x, grad_out)
    for layer in (grouped, loop):
        got = run_layer(layer, x, grad_out)
        assert got[0].dtype == torch.bfloat16
        assert all(g.dtype == torch.float32 for g in got[3].values())
        assert_same_run(got, ref_run, tol=BF16_TOL)


def test_bf16_activations_with_fp32_shared_experts():
    """The same mixed precision with a shared expert: the routed experts cast their fp32 weights
    to the activation dtype, so the shared expert must accept bf16 activations too."""
    cfg = make_config(activation="gelu", num_shared_experts=1)
    grouped, _ = make_layers(cfg)
    x, grad_out = inputs((16, DIM))
    x = x.bfloat16()
    assert_same_run(run_layer(grouped, x, grad_out), run_reference(grouped, x, grad_out), tol=BF16_TOL)


def test_all_tokens_to_one_expert_leaves_others_empty(grouped_mm_calls):
    # Only gate row 2 is non-zero and x > 0, so every token's first choice is expert 2 and its
    # second the tie-break winner among the zero logits, expert 0. Experts 1 and 3 get nothing.
    for capacity_factor, num_dropped in ((None, 0), (1.0, 16)):  # capacity ceil(1.0*16*2/4) = 8
        cfg = make_config(activation="swiglu", capacity_factor=capacity_factor)
        grouped, loop = make_layers(cfg)
        with torch.no_grad():
            for layer in (grouped, loop):
                layer.router.gate.weight.zero_()
                layer.router.gate.weight[2] = 0.3
        x, grad_out = inputs((16, DIM))
        x = x.abs() + 0.1
        ref_run = run_reference(grouped, x, grad_out)
        assert ref_run[0].num_routed_per_expert == [16, 0, 16, 0]
        assert ref_run[0].num_dropped == num_dropped
        for layer in (grouped, loop):
            got = run_layer(layer, x, grad_out)
            assert_same_run(got, ref_run, tol=FP32_TOL)
            if capacity_factor is not None:  # position: tokens 8..15 lost both copies
                assert torch.equal(got[0][8:], torch.zeros(8, DIM))
            for name in ("experts.w1", "experts.w2", "experts.w3"):  # empty experts: exact zero gradient
                assert got[3][name][[1, 3]].abs().sum() == 0
    assert grouped_mm_calls


def test_top_k_equal_to_num_experts():
    cfg = make_config(top_k=NUM_EXPERTS, activation="gelu", **MODES["capacity_position"])
    grouped, loop = make_layers(cfg)
    x, grad_out = inputs((16, DIM))
    ref_run = run_reference(grouped, x, grad_out)
    assert ref_run[0].num_routed_per_expert == [16] * NUM_EXPERTS
    for layer in (grouped, loop):
        assert_same_run(run_layer(layer, x, grad_out), ref_run, tol=FP32_TOL)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_experts_with_empty_groups_match_reference(activation, grouped_mm_calls):
    torch.manual_seed(0)
    counts = [3, 0, 5, 0, 0, 2]
    grouped = GroupedExperts(DIM, HIDDEN, len(counts), activation=activation, impl="grouped", init_std=0.3)
    loop = GroupedExperts(DIM, HIDDEN, len(counts), activation=activation, impl="loop")
    loop.load_state_dict(grouped.state_dict())
    x_MD, grad_MD = inputs((sum(counts), DIM))
    params = {n: p.detach().clone().requires_grad_() for n, p in grouped.named_parameters()}
    x_ref = x_MD.clone().requires_grad_()
    y_ref = reference_experts(x_ref, counts, params, activation)
    (y_ref * grad_MD).sum().backward()
    for experts in (grouped, loop):
        x = x_MD.clone().requires_grad_()
        y = experts(x, torch.tensor(counts))
        torch.testing.assert_close(y, y_ref, **FP32_TOL)
        (y * grad_MD).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, **FP32_TOL)
        for n, p in experts.named_parameters():
            torch.testing.assert_close(p.grad, params[n].grad, **FP32_TOL)
            assert p.grad[[1, 3, 4]].abs().sum() == 0
    assert grouped_mm_calls


@pytest.mark.parametrize("drop_policy", ["position", "score"])
@pytest.mark.parametrize("expert_impl", ["grouped", "loop"])
def test_dropless_equals_capacity_mode_with_room_for_everything(expert_impl, drop_policy):
    # capacity_factor = E gives ceil(E * T * K / E) = T * K slots per expert: nothing can drop.
    cfg = make_config(activation="swiglu", num_shared_experts=1, expert_impl=expert_impl)
    grouped, loop = make_layers(cfg)
    dropless = grouped if expert_impl == "grouped" else loop
    capacity = MoELayer(DIM, replace(cfg, capacity_factor=float(NUM_EXPERTS), drop_policy=drop_policy))
    capacity.load_state_dict(dropless.state_dict())
    x, grad_out = inputs((2, 8, DIM))
    out_a, aux_a, x_grad_a, grads_a = run_layer(dropless, x, grad_out)
    out_b, aux_b, x_grad_b, grads_b = run_layer(capacity, x, grad_out)
    assert int(aux_b.num_dropped) == 0
    assert float(aux_b.dropped_fraction) == 0.0
    assert aux_a.num_routed_per_expert.tolist() == aux_b.num_routed_per_expert.tolist()
    torch.testing.assert_close(out_b, out_a, **FP32_TOL)
    torch.testing.assert_close(x_grad_b, x_grad_a, **FP32_TOL)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **FP32_TOL)
    torch.testing.assert_close(aux_b.loss, aux_a.loss, **FP32_TOL)


def test_tokens_per_expert_buffer_holds_the_routed_counts_of_the_last_forward():
    cfg = make_config(**MODES["capacity_position"])
    layer, _ = make_layers(cfg)
    assert layer.tokens_per_expert.tolist() == [0] * NUM_EXPERTS
    for seed in (1, 2):
        x, _ = inputs((16, DIM), seed=seed)
        ref_run = run_reference(layer, x, torch.zeros(16, DIM))
        with torch.no_grad():
            _, aux = layer(x)
        # Counts of this forward only (not accumulated), before capacity drops.
        assert layer.tokens_per_expert.tolist() == ref_run[0].num_routed_per_expert
        assert sum(layer.tokens_per_expert.tolist()) == 16 * TOP_K
        assert int(aux.num_dropped) > 0
    # A different batch size: still exactly this forward's counts.
    x, _ = inputs((5, DIM), seed=3)
    layer(x)
    ref = run_reference(layer, x, torch.zeros(5, DIM))[0]
    assert layer.tokens_per_expert.tolist() == ref.num_routed_per_expert


def test_tokens_per_expert_buffer_stays_exact_after_a_bf16_cast():
    # With K = E = 2 every token goes to both experts: 257 copies each. bf16 holds integers
    # exactly only up to 256, so a float buffer cast by layer.to(bfloat16) would read 256 or 258.
    cfg = make_config(num_experts=2, top_k=2, expert_hidden_dim=8)
    layer = MoELayer(8, cfg).to(torch.bfloat16)
    with torch.no_grad():
        layer(torch.randn(257, 8, dtype=torch.bfloat16))
    assert layer.tokens_per_expert.tolist() == [257, 257]
