"""The forked gloo launcher itself: results come back in rank order, a failing rank fails the
test with its traceback (the cause before its peers' echoes), and a hung collective fails after
the timeout instead of blocking."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_launcher import RankError, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "world": dist.get_world_size()}


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("parallel.ep (3) must divide moe.num_experts (8)")
    dist.barrier()  # rank 0 is left waiting: the launcher must not wait for it


def _rank1_skips_collective(rank, world_size):
    if rank == 0:
        dist.barrier()
    else:
        time.sleep(60)  # alive but never joins: rank 0 blocks, as in a real mismatch of collectives


def test_results_in_rank_order():
    assert run_ranks(_sum_ranks, 2) == [{"rank": r, "sum": 1.0, "world": 2} for r in range(2)]


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RankError, match=r"rank 1 of 2 failed:(.|\n)*parallel.ep \(3\) must divide"):
        run_ranks(_rank1_raises, 2, timeout_s=30)


def test_hang_fails_after_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 1"):
        run_ranks(_rank1_skips_collective, 2, timeout_s=1)
    assert time.monotonic() - t0 < 15


def _rank1_fails_after_its_group(rank, world_size):
    if rank == 1:
        # The group goes first, the report a second later: rank 0's echo ("Connection closed by
        # peer" in its collective) reaches the launcher before the cause does.
        dist.destroy_process_group()
        time.sleep(1.0)
        raise ValueError("the cause, from rank 1")
    dist.all_reduce(torch.ones(1))


def test_the_cause_is_reported_before_the_peers_echo():
    with pytest.raises(RankError) as info:
        run_ranks(_rank1_fails_after_its_group, 2, timeout_s=20)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed"), message[:300]
    assert "ValueError: the cause, from rank 1" in message
