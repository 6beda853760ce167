"""Gradient reductions overlap the backward at every ZeRO stage, in every compression mode, on
real gloo processes (4 ranks, ep = 2: dp = 4, edp = 2; two MoE blocks; DDP buckets of 0.01 MB).

Recorded for every reduction collective a backward issues, at the dispatcher (so DDP's own C++
bucket all-reduces count too; ``grad_overlap_worker``): its group, whether it was issued while
the backward ran, and whether it was asynchronous; and where it falls against the backward
reaching the embedding, whose weight gradient is the model's last. Required:

* every gradient reduction is issued inside the backward, and at least one before the last
  gradient exists;
* stages 0/1: DDP's bucket all-reduces (over dp) are asynchronous and all but the last bucket's
  issued before the last gradient; the expert all-reduces (over edp), one per expert
  gradient, all asynchronous and all issued before the last gradient;
* stages 2/3: FSDP2's reduce-scatters, one per unit, those of the blocks and expert units
  before the last gradient (on a GPU they run on FSDP's reduce-scatter stream: their issue time
  is what matters; on CPU a gloo call blocks either way);
* every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.workers.grad_overlap_worker import (
    EMBEDDING_GRAD,
    bf16_expert_worker,
    finalize_worker,
    overlap_worker,
)
from tests.helpers.dist_launcher import run_ranks

CASES = [(0, "none"), (0, "bf16"), (1, "none"), (1, "bf16"), (2, "none"), (3, "none")]


def _split(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """The gradient reductions issued before the backward reached the embedding, and after."""
    marks = [i for i, e in enumerate(events) if e["op"] == EMBEDDING_GRAD]
    assert len(marks) == 1, events
    return events[:marks[0]], events[marks[0] + 1:]


@pytest.mark.slow
def test_gradient_reductions_overlap_the_backward():
    ranks = run_ranks(overlap_worker, 4, CASES, timeout_s=300)
    for case in CASES:
        stage = case[0]
        seen = [r[case] for r in ranks]
        shapes = [[(e["op"], e.get("group")) for e in s["events"]] for s in seen]
        assert all(s == shapes[0] for s in shapes), (case, shapes)  # same collectives, same order
        for s in seen:
            events = [e for e in s["events"] if e["op"] != EMBEDDING_GRAD]
            assert events and all(e["in_backward"] for e in events), (case, s["events"])
            before, after = _split(s["events"])
            assert before, (case, s["events"])
            if stage <= 1:
                buckets = [e for e in events if e["group"] == "dp"]
                experts = [e for e in events if e["group"] == "edp"]
                assert all(e["op"] == "all_reduce" and e["async"] for e in events), (case, events)
                assert len(buckets) >= 3 and len(experts) == s["num_expert_params"] > 0, (case, events)
                assert len([e for e in before if e["group"] == "dp"]) >= len(buckets) - 1, (case, events)
                assert all(e["group"] == "dp" for e in after), (case, s["events"])
            else:
                assert all(e["op"] == "reduce_scatter" for e in events), (case, events)
                # Units: the expert and block units of both blocks before the embedding, the root after.
                assert [e["group"] for e in after] == ["dp"], (case, s["events"])
                assert sorted(e["group"] for e in before) == ["dp", "dp", "edp", "edp"], (case, s["events"])


@pytest.mark.slow
def test_bf16_expert_reduction_is_the_bf16_sum_of_scaled_local_gradients():
    """The expert gradients' asynchronous bf16 reduction, by hand: over edp = 2 ranks each
    gradient is bf16(bf16(g_a / W) + bf16(g_b / W)) (one rounded addition: exact whatever the
    collective's order), the same bits on both copies."""
    world = 4
    ranks = run_ranks(bf16_expert_worker, world, timeout_s=120)
    for r, res in enumerate(ranks):
        a, b = res["edp_ranks"]
        assert r in (a, b) and a != b
        for n, got in res["reduced"].items():
            half_a = (ranks[a]["local"][n] / world).to(torch.bfloat16)
            half_b = (ranks[b]["local"][n] / world).to(torch.bfloat16)
            assert got.dtype == torch.float32
            assert torch.equal(got, (half_a + half_b).float()), n


@pytest.mark.slow
def test_finalize_grads_applies_the_hooks_rule_to_a_bare_model():
    """One rule, two places that apply it: ``finalize_grads`` on the bare model (what a pipeline
    stage gets) reduces one backward to the gradients ``MoEDataParallel``'s hooks give (experts
    bit for bit: a sum of two copies; dense within fp32 rounding: the 4-rank sum runs in another
    buffer layout), and after the hooks it has nothing left to do."""
    ranks = run_ranks(finalize_worker, 4, timeout_s=120)
    for res in ranks:
        experts = set(res["experts"])
        assert experts and set(res["finalize"]) == set(res["hooks"])
        for n, hooked in res["hooks"].items():
            assert torch.equal(res["hooks_then_finalize"][n], hooked), n
            assert not torch.equal(res["local"][n], res["finalize"][n]), n  # reduced: not the local gradient
            if n in experts:
                assert torch.equal(res["finalize"][n], hooked), n
            else:
                torch.testing.assert_close(res["finalize"][n], hooked, rtol=1e-5, atol=1e-8, msg=n)
