"""Expert rebalancing's placement (hand-worked plans, shares, the tables the dispatcher reads, the
replica exchange) and its config rules."""

import json

import pytest

from moetrain.config.parallel import ParallelConfig, check_rebalancing
from moetrain.distributed.expert_parallel.placement import (
    SHARE_UNITS,
    Placement,
    home_placement,
    plan_placement,
)
from moetrain.distributed.expert_parallel.rebalance import replica_routes
from moetrain.models.moe.skew import skew_weights


def test_hand_worked_plan_splits_the_hot_expert_and_levels_the_ranks():
    # Homes: rank 0 experts 0, 1 (load 8), rank 1 experts 2, 3 (load 2); one spare slot each.
    # Rank 0's hottest expert 0 goes to rank 1's spare; water-filled it splits 3 / 3 (levels 5, 5).
    # Rank 0's spare cannot take 0 or 1 (homed there) and rank 1's is used: rank 1's expert 2,
    # the next it serves, fills it, with share 0 (rank 0 is already at the level).
    p = plan_placement([6, 2, 1, 1], num_ranks=2, slots_per_rank=3)
    assert p.replicas == ((2,), (0,))
    half = SHARE_UNITS // 2
    assert p.copies[0] == ((0, half), (5, half))  # home slot 0, rank 1's spare = global slot 3 + 2
    assert p.copies[1] == ((1, SHARE_UNITS),)
    assert p.copies[2] == ((2, 0), (3, SHARE_UNITS))  # rank 0's spare (slot 2) first by global slot
    assert p.rank_loads([6, 2, 1, 1]) == [5.0, 5.0]


def test_tables_cut_each_expert_by_its_cumulative_shares():
    p = plan_placement([6, 2, 1, 1], num_ranks=2, slots_per_rank=3)
    slot_EC, end_EC = p.tables()
    half = SHARE_UNITS // 2
    assert slot_EC.tolist() == [[0, 5], [1, 1], [2, 3], [4, 4]]
    assert end_EC.tolist() == [[half, SHARE_UNITS], [SHARE_UNITS] * 2, [0, SHARE_UNITS], [SHARE_UNITS] * 2]


@pytest.mark.parametrize(("num_experts", "num_ranks", "slots"), [(8, 4, 3), (8, 2, 5), (16, 4, 5)])
def test_one_spare_slot_per_rank_levels_zipf(num_experts, num_ranks, slots):
    load = (skew_weights("zipf", (1.2,), step=1, num_experts=num_experts) * 10_000).tolist()
    L = num_experts // num_ranks
    before = [sum(load[p * L:(p + 1) * L]) for p in range(num_ranks)]
    plan = plan_placement(load, num_ranks=num_ranks, slots_per_rank=slots)
    after = plan.rank_loads(load)
    mean = sum(load) / num_ranks
    assert max(before) / mean > 1.5 and max(after) / mean <= 1.02, (before, after)
    assert all(sum(u for _, u in c) == SHARE_UNITS for c in plan.copies)
    assert all(len(r) == slots - L for r in plan.replicas)
    # The same on every rank: a pure function of the load.
    assert plan_placement(load, num_ranks=num_ranks, slots_per_rank=slots) == plan


def test_without_spare_slots_the_plan_is_the_home_layout():
    p = home_placement(8, num_ranks=4, slots_per_rank=2)
    assert p.replicas == ((),) * 4
    assert [c[0][0] for c in p.copies] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_replica_routes_pair_homes_with_spare_slots():
    p = plan_placement([6, 2, 1, 1], num_ranks=2, slots_per_rank=3)  # replicas ((2,), (0,))
    r0, r1 = replica_routes(p, rank=0), replica_routes(p, rank=1)
    # Rank 0 homes expert 0 (local 0) and sends it to rank 1; it receives expert 2 from rank 1.
    assert (r0.send_home_idx, r0.send_splits, r0.recv_bank_idx, r0.recv_splits) == ([0], [0, 1], [0], [0, 1])
    assert (r1.send_home_idx, r1.send_splits, r1.recv_bank_idx, r1.recv_splits) == ([0], [1, 0], [0], [1, 0])


_RULE_DEFAULTS = {"num_experts": 8, "is_moe": True, "expert_choice": False, "grad_compression": "none"}


@pytest.mark.parametrize(("parallel", "every", "field"), [
    ({"ep": 2, "expert_slots_per_rank": 5}, 0, "parallel.expert_slots_per_rank"),
    ({"ep": 2}, 3, "moe.rebalance_every"),
    ({"ep": 1, "expert_slots_per_rank": 9}, 1, "parallel.expert_slots_per_rank"),
    ({"ep": 2, "expert_slots_per_rank": 4}, 1, "parallel.expert_slots_per_rank"),
    ({"ep": 2, "expert_slots_per_rank": 5, "zero_stage": 2}, 1, "parallel.zero_stage"),
    ({"ep": 2, "expert_slots_per_rank": 5, "tp": 2}, 1, "parallel.tp"),
    ({"ep": 2, "expert_slots_per_rank": 5, "etp": 2}, 1, "parallel.etp"),
    ({"ep": 2, "expert_slots_per_rank": 5, "pp": 2}, 1, "parallel.pp"),
])
def test_rebalancing_rules_name_the_field(parallel, every, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_rebalancing(ParallelConfig(**parallel), rebalance_every=every, **_RULE_DEFAULTS)


@pytest.mark.parametrize(("change", "message"), [
    # A dense model: the slots are what is wrong, not moe.rebalance_every (which is set).
    ({"is_moe": False}, r"parallel\.expert_slots_per_rank \(5\) needs a model with MoE layers"),
    # More slots than experts: a rank would hold an expert twice, the extra slot never used.
    ({"num_experts": 4, "slots": 6}, r"parallel\.expert_slots_per_rank \(6\) must be <= moe\.num_experts \(4\)"),
    ({"grad_compression": "onebit"}, r"dp\.grad_compression \('onebit'\) must be 'none' or 'bf16' with expert"),
])
def test_rebalancing_rules_for_the_model_and_the_optimizer(change, message):
    args = {**_RULE_DEFAULTS, **change}
    slots = args.pop("slots", 5)
    with pytest.raises(ValueError, match=message):
        check_rebalancing(ParallelConfig(ep=2, expert_slots_per_rank=slots), rebalance_every=5, **args)


def test_rebalancing_layout_accepted_and_negative_slots_refused():
    check_rebalancing(ParallelConfig(ep=2, expert_slots_per_rank=5, zero_stage=1), rebalance_every=10,
                      **_RULE_DEFAULTS)
    check_rebalancing(ParallelConfig(ep=2, expert_slots_per_rank=8), rebalance_every=10, **_RULE_DEFAULTS)
    # A dense model ignores moe.rebalance_every without slots (a preset's moe section may set it).
    check_rebalancing(ParallelConfig(ep=2), rebalance_every=10, **{**_RULE_DEFAULTS, "is_moe": False})
    with pytest.raises(ValueError, match=r"parallel\.expert_slots_per_rank \(-1\)"):
        ParallelConfig(expert_slots_per_rank=-1)


def test_a_saved_placement_round_trips_and_a_tampered_one_is_refused():
    plan = plan_placement([50, 1, 1, 1, 9, 9, 30, 2], num_ranks=4, slots_per_rank=4)
    saved = json.loads(json.dumps(plan.to_json()))  # as a checkpoint's trainer state holds it
    assert Placement.from_json(saved) == plan
    moved = json.loads(json.dumps(saved))
    moved["copies"][0][0][1] += 1  # expert 0's shares no longer sum to SHARE_UNITS
    swapped = json.loads(json.dumps(saved))
    swapped["replicas"][0][0] = (swapped["replicas"][0][0] + 1) % 8  # a copy on a slot holding another expert
    for bad in (moved, swapped, {**saved, "copies": "x"}, {k: v for k, v in saved.items() if k != "replicas"}):
        with pytest.raises(ValueError, match="expert placement"):
            Placement.from_json(bad)
