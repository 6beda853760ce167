"""Every router and the between-step balancing under expert x data parallelism, on real gloo
processes, against one plain process with the global batch (routing_parity.py): outputs, losses,
drops, every gradient, the parameters after several AdamW steps, and after every step the
balancing state (selection bias, capacity factor, per-expert learning-rate scales, aux-loss
coefficient) on every rank. The DeepSeek-V3 and Qwen2-MoE cases add a fixed selection bias, the
routed scaling factor and the gated shared expert.
"""

import pytest
import torch

from tests.distributed.workers.ep_parity import assert_parity, make_data
from tests.distributed.workers.routing_parity import (
    RoutingCase,
    assert_balance_parity,
    build_routing_model,
    routing_worker,
    run_reference,
)
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

# A large bias step (0.05 against sigmoid scores that differ by ~0.02 at init) so the bias really
# re-routes tokens within the few steps.
SIGMOID_BIAS = RoutingCase("sigmoid_bias", moe={"router": "sigmoid", "router_bias_update_rate": 0.05,
                                                "aux_loss_coef": 0.0}, steps=4)
# Gradient accumulation under activation checkpointing: the step's counts are summed over both
# micro-batches once each (the recomputed forward is not counted).
SIGMOID_BIAS_ACCUM = RoutingCase("sigmoid_bias_accum", moe={"router": "sigmoid", "router_bias_update_rate": 0.05,
                                                            "aux_loss_coef": 0.0},
                                 steps=4, micro_batches=2, activation_checkpointing=True)
EXPERT_CHOICE = RoutingCase("expert_choice", moe={"router": "expert_choice", "capacity_factor": 1.0,
                                                  "num_shared_experts": 1})
# Groups aligned with ep=2: group g is rank g's four experts.
GROUPS = RoutingCase("groups_bias", moe={"num_expert_groups": 2, "top_groups": 1,
                                         "router_bias_update_rate": 0.01})
DYNAMIC = RoutingCase("dynamic_capacity", moe={"capacity_factor": 1.0, "dynamic_capacity": True,
                                               "balance_interval": 1}, steps=4)
LR_SCALE = RoutingCase("expert_lr_scale", moe={"expert_lr_scale_max": 3.0, "balance_interval": 1})
SEQ_AUX = RoutingCase("sequence_aux", moe={"aux_loss_type": "sequence", "aux_loss_coef": 0.1}, seq_len=4)
# Layer 0 sends every token to expert 0: with no warm-up and one check in a row, the alarm fires at
# each step and raises that layer's coefficient on every rank alike.
# DeepSeek-V3's MoE block: sigmoid scores, a fixed (imported) selection bias, group-limited routing
# over groups that straddle the ep ranks, routed weights scaled by 2.5, a shared expert.
DEEPSEEK_V3 = RoutingCase("deepseek_v3", moe={"router": "sigmoid", "expert_bias": True, "routed_scaling_factor": 2.5,
                                              "num_expert_groups": 4, "top_groups": 2, "num_shared_experts": 1,
                                              "activation": "swiglu"}, bias_std=0.1)
# Qwen2-MoE's: raw softmax weights of 4 experts, a shared expert behind its sigmoid gate (the
# collapse alarm above top_k / E = 0.5, where it can fire).
QWEN2_MOE = RoutingCase("qwen2_moe", moe={"top_k": 4, "renormalize": False, "num_shared_experts": 1,
                                          "shared_expert_gate": True, "activation": "swiglu",
                                          "collapse_threshold": 0.9})
COLLAPSE = RoutingCase("collapse", moe={"top_k": 1, "collapse_threshold": 0.5, "collapse_aux_increase": 0.05,
                                        "balance_interval": 1, "collapse_warmup_steps": 0,
                                        "collapse_consecutive_checks": 1}, force="one_expert")


def _check(layouts, results, world_size):
    for ep, cases in layouts:
        for case in cases:
            ranks = [r[f"ep{ep}/{case.name}"] for r in results]
            ref = run_reference(case, world_size)
            assert_parity(case, ranks, ref, ep=ep)
            assert_balance_parity(case, ranks, ref, ep=ep)
            _check_case_is_what_it_claims(case, ref, ranks, ep)


def _check_case_is_what_it_claims(case, ref, ranks, ep):
    moe = case.moe
    last = ref["steps"][-1]["balance"]
    if moe.get("router_bias_update_rate", 0) > 0:
        assert last["expert_bias"].abs().max() > 0
    if moe.get("router") == "expert_choice":
        assert sum(sum(d) for st in ref["steps"] for d in st["dropped"]) > 0, "no token was skipped"
    if moe.get("dynamic_capacity"):
        assert any(f != 1.0 for st in ref["steps"] for f in st["balance"]["capacity_factor"])
        assert sum(sum(d) for st in ref["steps"] for d in st["dropped"]) > 0, "no copy was dropped"
    if moe.get("expert_lr_scale_max", 1) > 1:
        assert last["expert_lr_scale"].max() > 1
    if moe.get("expert_bias") and moe.get("router_bias_update_rate", 0) == 0:
        _check_fixed_bias(case, ref, ranks)
    if moe.get("num_expert_groups", 1) == ep == 2 and moe.get("top_groups", 1) == 1:
        # Groups aligned with the ranks: all K copies of a token go to the same rank, so the
        # per-copy all-to-all moves exactly K rows per (token, remote rank) pair. Each remote copy
        # is sent twice (there by dispatch, back by combine), once by each side.
        top_k = moe.get("top_k", 2)
        count_bytes = 2 * case.micro_batches * (ep - 1) * (8 // ep) * 8  # 2 layers' int64 count exchanges
        for s in range(case.steps):
            sent = sum(rank["steps"][s]["comm"].bytes_sent - count_bytes for rank in ranks)
            remote_copies = sent // (2 * case.dim * 4)
            pairs = sum(sum(sends) for rank in ranks for sends in rank["steps"][s]["sends"])
            assert remote_copies == top_k * pairs, (s, remote_copies, pairs)
    if case.force == "one_expert":
        assert ref["alarms"] > 0 and last["aux_loss_coef"][0] > moe.get("aux_loss_coef", 0.01)


def _check_fixed_bias(case, ref, ranks):
    """A fixed bias is the one the case set, after every step on every rank, and it re-routes."""
    model = build_routing_model(case)
    initial = torch.stack([layer.router.expert_bias for layer in model.layers])
    assert initial.abs().max() > 0
    for run in (ref, *ranks):
        for step in run["steps"]:
            assert torch.equal(step["balance"]["expert_bias"], initial), case.name
    x, _ = make_data(case, 1)
    router = model.layers[0].router
    with torch.no_grad():
        biased = router(x[0]).idx_TK
        router.expert_bias.zero_()
        assert not torch.equal(biased, router(x[0]).idx_TK), "the bias must change some selection"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_routers_ep2_world2_match_single_process():
    layouts = [(2, [SIGMOID_BIAS, SIGMOID_BIAS_ACCUM, EXPERT_CHOICE, GROUPS, DYNAMIC, LR_SCALE, SEQ_AUX, COLLAPSE,
                    DEEPSEEK_V3, QWEN2_MOE]),
               # Plain data parallelism: expert choice and dynamic capacity still cut over the global batch.
               (1, [EXPERT_CHOICE, DYNAMIC])]
    _check(layouts, run_ranks(routing_worker, 2, layouts, timeout_s=180), 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_routers_dp2_ep2_world4_match_single_process():
    layouts = [(2, [SIGMOID_BIAS_ACCUM, EXPERT_CHOICE, DYNAMIC, LR_SCALE, DEEPSEEK_V3])]
    _check(layouts, run_ranks(routing_worker, 4, layouts, timeout_s=180), 4)
