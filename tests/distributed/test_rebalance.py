"""Expert rebalancing (parallel.expert_slots_per_rank, moe.rebalance_every) on real gloo processes:
the same training with and without replicas of hot experts agrees in every loss, drop, gradient,
weight and optimizer state, at ep=2 (edp=2) and ep=4, ZeRO 0 and 1, top-2 with group-limited
routing, dropless (once per rank, LoRA on the experts) and under a capacity factor ("position" and
"score", dispatch chunks); a skipped step leaves no load in the history and defers its re-plan;
and the replicas take the hot rank's load (rebalance_parity.py)."""

import pytest

from tests.distributed.workers.rebalance_parity import RebalanceCase, rebalance_worker
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GROUPS = {"num_expert_groups": 4, "top_groups": 2}
CASES = [
    RebalanceCase("ep4-zero0-groups-dropless-dedup-lora", ep=4, zero_stage=0, slots_per_rank=3,
                  moe={**GROUPS, "dispatch_dedup": True}, micro_batches=2, lora=True),
    RebalanceCase("ep2-zero1-capacity-position-skip", ep=2, zero_stage=1, slots_per_rank=5,
                  moe={"capacity_factor": 1.0}, skip_step=1),
    RebalanceCase("ep4-zero1-capacity-score-chunks", ep=4, zero_stage=1, slots_per_rank=4,
                  moe={**GROUPS, "capacity_factor": 1.25, "drop_policy": "score", "dispatch_chunks": 2}),
]


def test_rebalancing_changes_no_number_and_spreads_the_hot_rank():
    results = run_ranks(rebalance_worker, 4, CASES, timeout_s=200)
    for rc in CASES:
        # Layer 0 sends every token to experts 0 and 1 (home: ep rank 0); after the first plan the
        # replicas on the other ranks take their share of them.
        recv_last = [results[r][rc.name]["recv"][-1][0] for r in range(rc.ep)]
        mean = sum(recv_last) / len(recv_last)
        assert max(recv_last) <= 1.5 * mean, f"{rc.name}: layer 0 copies per rank {recv_last}"
        dropless = "capacity" not in rc.name
        total_drops = sum(sum(d) for r in results for step in r[rc.name]["dropped"] for d in step)
        assert (total_drops == 0) == dropless, f"{rc.name}: drops {total_drops}"
