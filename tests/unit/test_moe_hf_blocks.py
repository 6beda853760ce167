"""moetrain's MoE layer against transformers' own MoE blocks: the independent reference.

For each family the Hugging Face block is built from its config class with tiny sizes and random
weights (router weights large enough that no top-k is decided by a near-tie, DeepSeek-V3's
e_score_correction_bias non-zero), the weights are copied into a ``MoELayer``, and both see the
same tokens: outputs, input gradients and every parameter's gradient must agree to 1e-5 in
fp32, with the same experts selected for every token, in both expert implementations ("grouped" and its oracle "loop").
Guards make sure each feature changes the result it is meant to change (the bias and the group
limit re-route tokens, "max" and "top2_sum" group scores pick different groups, the shared gate
is not a constant), so a layer that ignored it would fail.

transformers >= 5 stores the experts fused: ``gate_up_proj [E, 2F, D]`` (gate rows first) and
``down_proj [E, D, F]``; moetrain stacks ``w1``/``w3 [E, D, F]`` and ``w2 [E, F, D]``.

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, F expert hidden dim, E experts,
K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer

D, F, SHARED_F = 16, 24, 20
B, S = 2, 12
TOL = {"rtol": 1e-5, "atol": 1e-5}
ROUTER_STD = 1.0
"""Router weights of std 1 over unit inputs give logits of std ~4: the K-th and (K+1)-th scores
of a token are far apart next to fp32 rounding, so both sides select the same experts."""
# Attention fields the config validators check (the MoE blocks do not read them), and HF's plain
# per-expert loop as its experts' implementation.
ATTN = {"num_attention_heads": 2, "num_key_value_heads": 2, "experts_implementation": "eager"}


@dataclass
class Family:
    block: type
    config: object
    moe: dict
    """MoEConfig fields that describe the same block."""
    guards: list[str] = field(default_factory=list)
    """Features whose effect the case must show: "bias", "groups", "group_score", "shared_gate"."""


def _families() -> dict[str, Family]:
    swiglu = {"activation": "swiglu", "expert_hidden_dim": F, "aux_loss_coef": 0.0, "z_loss_coef": 0.0}
    return {
        "mixtral": Family(
            MixtralSparseMoeBlock,
            MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=8, num_experts_per_tok=2, **ATTN),
            {**swiglu, "num_experts": 8, "top_k": 2, "renormalize": True}),
        # norm_topk_prob False: Qwen2-MoE's default (Qwen1.5-MoE-A2.7B ships it).
        "qwen2_moe": Family(
            Qwen2MoeSparseMoeBlock,
            Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=F, shared_expert_intermediate_size=SHARED_F,
                           num_experts=8, num_experts_per_tok=4, norm_topk_prob=False, **ATTN),
            {**swiglu, "num_experts": 8, "top_k": 4, "renormalize": False, "num_shared_experts": 1,
             "shared_hidden_dim": SHARED_F, "shared_expert_gate": True},
            ["shared_gate"]),
        # norm_topk_prob True: what Qwen3-30B-A3B ships (the config class defaults to False).
        "qwen3_moe": Family(
            Qwen3MoeSparseMoeBlock,
            Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=8, num_experts_per_tok=4,
                           norm_topk_prob=True, **ATTN),
            {**swiglu, "num_experts": 8, "top_k": 4, "renormalize": True}),
        "olmoe": Family(
            OlmoeSparseMoeBlock,
            OlmoeConfig(hidden_size=D, intermediate_size=F, num_experts=8, num_experts_per_tok=2,
                        norm_topk_prob=False, **ATTN),
            {**swiglu, "num_experts": 8, "top_k": 2, "renormalize": False}),
        "deepseek_v3": Family(
            DeepseekV3MoE,
            DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=16, num_experts_per_tok=4,
                             n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                             norm_topk_prob=True, **ATTN),
            {**swiglu, "num_experts": 16, "top_k": 4, "router": "sigmoid", "renormalize": True,
             "expert_bias": True, "num_expert_groups": 4, "top_groups": 2, "routed_scaling_factor": 2.5,
             "num_shared_experts": 1},
            ["bias", "groups"]),
        # DeepSeek-V2: group_limited_greedy over softmax scores, the raw (never renormalised)
        # weights scaled by routed_scaling_factor.
        "deepseek_v2": Family(
            DeepseekV2Moe,
            DeepseekV2Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=16, num_experts_per_tok=4,
                             n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2,
                             routed_scaling_factor=16.0, **ATTN),
            {**swiglu, "num_experts": 16, "top_k": 4, "renormalize": False, "num_expert_groups": 4,
             "top_groups": 2, "group_score": "max", "routed_scaling_factor": 16.0, "num_shared_experts": 2},
            ["groups", "group_score"]),
        # DeepSeek-V2-Lite: greedy top-k over softmax, no groups, no scaling.
        "deepseek_v2_lite": Family(
            DeepseekV2Moe,
            DeepseekV2Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=16, num_experts_per_tok=4,
                             topk_method="greedy", n_shared_experts=2, **ATTN),
            {**swiglu, "num_experts": 16, "top_k": 4, "renormalize": False, "num_shared_experts": 2}),
    }


FAMILIES = _families()


def hf_block(family: Family, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    block = family.block(family.config).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0.0, ROUTER_STD if name == "gate.weight" else p.shape[-1] ** -0.5)
        for name, buf in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.2)  # sigmoid scores differ by ~0.1-0.5: a bias that re-routes
    return block


def to_moetrain(hf: dict[str, torch.Tensor], expert_hidden_dim: int) -> dict[str, torch.Tensor]:
    """HF names and layouts -> moetrain's (the mapping the interop converters use), for weights
    and for their gradients alike."""
    F_ = expert_hidden_dim
    gate_up_EHD = hf["experts.gate_up_proj"]  # H = 2F: the gate rows, then the up rows
    out = {"router.gate.weight": hf["gate.weight"],
           "experts.w1": gate_up_EHD[:, :F_].transpose(1, 2),
           "experts.w3": gate_up_EHD[:, F_:].transpose(1, 2),
           "experts.w2": hf["experts.down_proj"].transpose(1, 2)}
    if "gate.e_score_correction_bias" in hf:
        out["router.expert_bias"] = hf["gate.e_score_correction_bias"]
    for prefix in ("shared_expert.", "shared_experts."):
        if prefix + "gate_proj.weight" in hf:
            for mt, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"shared_experts.{mt}.weight"] = hf[f"{prefix}{name}.weight"]
    if "shared_expert_gate.weight" in hf:
        out["shared_gate.weight"] = hf["shared_expert_gate.weight"]
    return out


def copy_into(layer: MoELayer, block: nn.Module) -> None:
    weights = to_moetrain(block.state_dict(), layer.config.expert_hidden_dim)
    assert set(weights) == set(layer.state_dict()), "every tensor of each side has its counterpart"
    layer.load_state_dict(weights)


def moetrain_layer(family: Family, block: nn.Module, impl: str) -> MoELayer:
    layer = MoELayer(D, MoEConfig(**family.moe, expert_impl=impl)).eval()
    copy_into(layer, block)
    return layer


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(seed))


def hf_selection(block: nn.Module, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's experts and gate weights per token, sorted by expert id (its top-k order is unspecified)."""
    _, weights_TK, idx_TK = block.gate(x_TD)
    order_TK = idx_TK.argsort(dim=-1)
    return idx_TK.gather(1, order_TK), weights_TK.gather(1, order_TK)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_matches_the_hf_block(name, impl):
    family = FAMILIES[name]
    block = hf_block(family)
    layer = moetrain_layer(family, block, impl)
    x = tokens()

    # 1. The same experts for every token, with the same gate weights.
    x_TD = x.view(-1, D)
    want_idx_TK, want_w_TK = hf_selection(block, x_TD)
    routing = layer.router(x_TD)
    order_TK = routing.idx_TK.argsort(dim=-1)
    assert torch.equal(routing.idx_TK.gather(1, order_TK), want_idx_TK)
    torch.testing.assert_close(routing.weights_TK.gather(1, order_TK), want_w_TK.float(), **TOL)

    # 2. The same outputs and input gradients.
    x_hf, x_mt = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_BSD = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))
    want_BSD = block(x_hf)
    got_BSD, _ = layer(x_mt)
    (want_BSD * grad_BSD).sum().backward()
    (got_BSD * grad_BSD).sum().backward()
    assert got_BSD.shape == want_BSD.shape
    torch.testing.assert_close(got_BSD, want_BSD, **TOL)
    torch.testing.assert_close(x_mt.grad, x_hf.grad, **TOL)

    # 3. The same gradient for every parameter.
    hf_grads = {n: p.grad for n, p in block.named_parameters()}
    want_grads = to_moetrain(hf_grads, layer.config.expert_hidden_dim)
    got_grads = {n: p.grad for n, p in layer.named_parameters()}
    assert set(got_grads) == set(want_grads)
    for n, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def _selection_without(family: Family, change: dict, block_change=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected experts (sorted per token) of the family's layer, and of the same weights with
    ``change`` applied to its config (and ``block_change`` to the copied layer)."""
    block = hf_block(family)
    x_TD = tokens().view(-1, D)
    base = moetrain_layer(family, block, "loop")
    other = MoELayer(D, MoEConfig(**{**family.moe, **change})).eval()
    other.load_state_dict(base.state_dict(), strict=False)
    if block_change is not None:
        block_change(other)
    with torch.no_grad():
        a, b = base.router(x_TD).idx_TK, other.router(x_TD).idx_TK
    return a.sort(dim=-1).values, b.sort(dim=-1).values


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.guards])
def test_each_feature_changes_the_routing_of_its_case(name):
    """Guards: the parity above would not hold for a layer that ignored the feature."""
    family = FAMILIES[name]
    for guard in family.guards:
        if guard == "bias":
            a, b = _selection_without(family, {}, lambda layer: layer.router.expert_bias.zero_())
        elif guard == "groups":
            a, b = _selection_without(family, {"num_expert_groups": 1, "top_groups": 1, "group_score": "top2_sum"})
        elif guard == "group_score":
            a, b = _selection_without(family, {"group_score": "top2_sum"})
        else:
            assert guard == "shared_gate"
            block = hf_block(family)
            layer = moetrain_layer(family, block, "loop")
            gate_T = torch.sigmoid(tokens().view(-1, D) @ layer.shared_gate.weight.t())
            assert gate_T.std() > 0.1 and not torch.allclose(gate_T, torch.full_like(gate_T, 0.5), atol=0.05)
            continue
        assert not torch.equal(a, b), f"{name}: {guard} changes no selection"


def test_routed_scaling_factor_scales_the_routed_output_only():
    """out = shared + factor * routed: the routed part alone scales with the factor."""
    family = FAMILIES["deepseek_v3"]
    block = hf_block(family)
    x = tokens()
    outs = {}
    for factor in (1.0, 2.5):
        layer = MoELayer(D, MoEConfig(**{**family.moe, "routed_scaling_factor": factor})).eval()
        copy_into(layer, block)
        with torch.no_grad():
            outs[factor] = layer(x)[0]
            shared_BSD = layer.shared_experts(x)
    torch.testing.assert_close(outs[2.5] - shared_BSD, 2.5 * (outs[1.0] - shared_BSD), **TOL)
