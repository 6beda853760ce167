"""`moetrain plan`'s inter-node all-to-all bytes, flat vs hierarchical (parallel.ep_hierarchical):
the expected nodes a token meets under uniform routing, checked by enumerating every routing,
and the per-step bytes by hand."""

import itertools
import math
from dataclasses import replace

import pytest

from moetrain.config.presets import get_preset
from moetrain.plan import Layout, comm_per_step, param_specs
from moetrain.plan.comm import expected_groups_hit


@pytest.mark.parametrize("num_experts, top_k, num_groups", [(8, 2, 2), (8, 4, 2), (8, 2, 4), (16, 6, 4), (8, 1, 8)])
def test_expected_groups_hit_is_the_mean_over_every_routing(num_experts, top_k, num_groups):
    size = num_experts // num_groups
    routings = list(itertools.combinations(range(num_experts), top_k))
    mean = sum(len({e // size for e in experts}) for experts in routings) / len(routings)
    assert expected_groups_hit(num_experts, top_k, num_groups) == pytest.approx(mean, rel=1e-12)


def test_inter_node_all_to_all_flat_vs_hierarchical_by_hand():
    p = get_preset("tiny")
    model, moe = replace(p.model, vocab_size=4096, preset=None), replace(p.moe, num_experts=8, top_k=2)
    specs = param_specs(model, moe)
    D, T, accum, num_moe = model.dim, 256, 2, len(model.moe_layer_ids)

    def vol(ep, per_node, **kw):
        return comm_per_step(specs, Layout(world=8, ep=ep, zero_stage=0), model, moe, tokens_per_micro_batch=T,
                             grad_accum=accum, compute_bytes=4, procs_per_node=per_node, **kw)

    per_row = 2 * D * 4 * 2 * num_moe  # dispatch + combine, forward + backward, fp32
    flat, hier = vol(4, 2), vol(4, 2, ep_hierarchical=True)
    # ep=4 on 2 nodes of 2: flat, half of the K=2 copies cross; hierarchical, the other node once
    # when a token meets it: 2 * (1 - C(4,2)/C(8,2)) / 2 = 11/14 rows per token.
    assert flat.all_to_all_inter_node_flat == hier.all_to_all_inter_node_flat == int(T * 1.0 * per_row * accum)
    assert flat.all_to_all_inter_node_hierarchical == int(T * 11 / 14 * per_row * accum)
    # Only the chosen exchange counts in inter_node; the gradient all-reduce spans nodes in both.
    chosen = flat.all_to_all_inter_node_flat - flat.all_to_all_inter_node_hierarchical
    assert flat.inter_node - hier.inter_node == chosen
    # The hierarchical volume: 11/14 rows across, then each of the 2 ranks other than the relays
    # (one per node) gets the row when it holds an expert: 2 * (1 - C(6,2)/C(8,2)) = 13/28 each.
    assert flat.all_to_all == int(2 * T * 2 * D * 4 * (3 / 4) * 2 * num_moe * accum)  # the textbook per-copy volume
    assert hier.all_to_all == int(T * (11 / 14 + 2 * 13 / 28) * per_row * accum)
    # ep inside a node: nothing crosses, whatever the option.
    inside = vol(4, 4, ep_hierarchical=True)
    assert inside.all_to_all_inter_node_flat == inside.all_to_all_inter_node_hierarchical == 0
    assert inside.all_to_all == flat.all_to_all
    assert set(inside.as_dict()) >= {"all_to_all_inter_node_flat", "all_to_all_inter_node_hierarchical"}
    ratio = hier.all_to_all_inter_node_hierarchical / hier.all_to_all_inter_node_flat
    assert math.isclose(ratio, 11 / 14, rel_tol=1e-6)
