"""Every router and the between-step balancing under expert x data parallelism, on real gloo
processes, against one plain process with the global batch (routing_parity.py): outputs, losses,
drops, every gradient, the parameters after several AdamW steps, and after every step the
balancing state (selection bias, capacity factor, per-expert learning-rate scales, aux-loss
coefficient) on every rank.
"""

import pytest

from tests.distributed.dist_launcher import run_ranks
from tests.distributed.ep_parity import assert_parity
from tests.distributed.routing_parity import RoutingCase, assert_balance_parity, routing_worker, run_reference

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
    if moe.get("num_expert_groups", 1) > 1 and ep == 2:
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_routers_ep2_world2_match_single_process():
    layouts = [(2, [SIGMOID_BIAS, SIGMOID_BIAS_ACCUM, EXPERT_CHOICE, GROUPS, DYNAMIC, LR_SCALE, SEQ_AUX, COLLAPSE]),
               # Plain data parallelism: expert choice and dynamic capacity still cut over the global batch.
               (1, [EXPERT_CHOICE, DYNAMIC])]
    _check(layouts, run_ranks(routing_worker, 2, layouts, timeout_s=180), 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_routers_dp2_ep2_world4_match_single_process():
    layouts = [(2, [SIGMOID_BIAS_ACCUM, EXPERT_CHOICE, DYNAMIC, LR_SCALE])]
    _check(layouts, run_ranks(routing_worker, 4, layouts, timeout_s=180), 4)
