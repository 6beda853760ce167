"""Pipeline parallelism against one process holding the global batch (gloo, real processes).

Every case compares, at every step, the loss and aux-loss sums (mean over the dp ranks), the
clipped-or-not global gradient norm and every gradient of every stage (expert and FSDP shards
gathered to full tensors), and the parameters after three AdamW steps, with the one-process run
of ``tests.distributed.workers.pipeline_worker.run_reference`` (the same micro-batches accumulated).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.workers.pipeline_worker import PPCase, run_cases, run_reference
from tests.helpers.dist_launcher import run_ranks

pytestmark = pytest.mark.slow

ATOL = 2e-6

# routing_parity's options under pp = 2, with activation checkpointing and ZeRO-1/2 once each.
# The collapse alarm above top_k / E = 0.5, where it can fire (install_balancing warns otherwise).
SIGMOID_BIAS = {"router": "sigmoid", "router_bias_update_rate": 0.05, "aux_loss_coef": 0.0, "collapse_threshold": 0.9}
GROUPS = {"num_expert_groups": 2, "top_groups": 1}
ROUTING2 = [PPCase("capacity_ac", moe={"capacity_factor": 1.0}, activation_checkpointing="full"),
            PPCase("sigmoid_bias", balancing=True, moe=SIGMOID_BIAS), PPCase("groups", moe=GROUPS),
            PPCase("shared_expert_gate", moe={"num_shared_experts": 1, "shared_expert_gate": True})]
ROUTING4 = [PPCase("sigmoid_bias_dp2_zero1", balancing=True, zero_stage=1, moe=SIGMOID_BIAS),
            PPCase("groups_ep2_zero2", ep=2, zero_stage=2, moe=GROUPS)]
# The aux-loss gradient across micro-batch counts: tests/distributed/test_aux_invariance.py.
WORLD2 = [PPCase("gpipe", schedule="gpipe"), PPCase("1f1b", max_grad_norm=0.5),
          PPCase("interleaved", schedule="interleaved_1f1b", virtual_stages=2), *ROUTING2]
# Tensor parallelism inside the stages: ep folded onto the tp ranks (with activation checkpointing),
# ZeRO-1 (the optimizer slices each gradient as its parameter is split), ZeRO-2 (FSDP2 over the
# stage's dp x tp ranks), and the experts' hidden dim split over the tp pair (etp = 2).
PP_TP = [PPCase("pp2_tp2", tp=2, max_grad_norm=0.5),
         PPCase("pp2_tp2_ep2_ac", tp=2, ep=2, activation_checkpointing="full"),
         PPCase("pp2_tp2_zero1", tp=2, zero_stage=1), PPCase("pp2_tp2_ep2_zero2", tp=2, ep=2, zero_stage=2),
         PPCase("pp2_tp2_etp2", tp=2, etp=2)]
WORLD4 = [PPCase("pp2_ep2", ep=2), PPCase("pp2_dp2", max_grad_norm=0.5),
          PPCase("pp2_ep2_zero2", ep=2, zero_stage=2, max_grad_norm=0.5),
          PPCase("empty_experts", ep=2, empty_experts_from_layer=2), *ROUTING4, *PP_TP]


@pytest.fixture(scope="module")
def world2():
    out = run_ranks(run_cases, 2, WORLD2, timeout_s=120)
    return {c.name: (c, [o[c.name] for o in out]) for c in WORLD2}


@pytest.fixture(scope="module")
def world4():
    out = run_ranks(run_cases, 4, WORLD4, timeout_s=180)
    return {c.name: (c, [o[c.name] for o in out]) for c in WORLD4}


def assert_parity(case: PPCase, ranks: list[dict], dp: int) -> dict:
    ref = run_reference(case, dp)
    for step in range(case.steps):
        # Every rank returns the sums of its dp slice; the one-process value is their mean.
        by_dp = {r["dp_rank"]: r for r in ranks}
        loss = sum(by_dp[d]["loss"][step] for d in range(dp)) / dp
        aux = sum(by_dp[d]["aux"][step] for d in range(dp)) / dp
        assert loss == pytest.approx(ref["loss"][step], rel=1e-5)
        assert aux == pytest.approx(ref["aux"][step], rel=1e-5)
        for r in ranks:
            assert r["norm"][step] == pytest.approx(ref["norm"][step], rel=1e-5)
    seen = set()
    for r in ranks:
        for step, grads in enumerate(r["grads"]):
            for name, g in grads.items():
                torch.testing.assert_close(g, ref["grads"][step][name], atol=ATOL, rtol=1e-5, msg=name)
                seen.add(name)
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref["params"][name], atol=ATOL, rtol=1e-5, msg=name)
    # The stages together hold every gradient of the model.
    assert seen == set(ref["grads"][0])
    for step, want in enumerate(ref["expert_bias"]):
        got = {name: bias for r in ranks for name, bias in r["expert_bias"][step].items()}
        assert got.keys() == want.keys(), step
        for name, bias in want.items():
            torch.testing.assert_close(got[name], bias, rtol=1e-6, atol=1e-7, msg=f"step {step} {name} bias")
    return ref


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_pp2_schedules_match_one_process(world2, name):
    case, ranks = world2[name]
    assert_parity(case, ranks, dp=1)
    expected = [[0, 2], [1, 3]] if case.virtual_stages == 2 else [[0], [1]]
    assert [r["stage_ids"] for r in ranks] == expected


def test_pp2_clips_by_the_whole_model_norm(world2):
    case, ranks = world2["1f1b"]
    ref = assert_parity(case, ranks, dp=1)
    assert max(ref["norm"]) > case.max_grad_norm  # the clip acted, and acted alike


@pytest.mark.parametrize("name", ["pp2_ep2", "pp2_dp2", "pp2_ep2_zero2"])
def test_pp2_hybrids_match_one_process(world4, name):
    case, ranks = world4[name]
    assert_parity(case, ranks, dp=2)
    assert [r["stage_ids"] for r in ranks] == [[0], [0], [1], [1]]


@pytest.mark.parametrize("name", [c.name for c in PP_TP])
def test_pp2_tp2_matches_one_process(world4, name):
    case, ranks = world4[name]
    ref = assert_parity(case, ranks, dp=1)
    assert [r["stage_ids"] for r in ranks] == [[0], [0], [1], [1]]
    for r in ranks:
        # Every gradient is laid out as its parameter (the row-wise embedding's too), which the
        # ZeRO-1 slices and the dp reduction rely on.
        assert r["grad_layouts_match"], r["grad_layouts_match"]
    if case.max_grad_norm:
        assert max(ref["norm"]) > case.max_grad_norm


@pytest.mark.parametrize("name", [c.name for c in ROUTING2 + ROUTING4])
def test_routing_options_under_pp2(world2, world4, name):
    """Capacity drops and bias updates count what one process counts: every stage's layers see
    every micro-batch; the bias is the reference's after every step on every rank."""
    world, dp = (world2, 1) if name in world2 else (world4, 2)
    case, ranks = world[name]
    ref = assert_parity(case, ranks, dp=dp)
    if "capacity_factor" in case.moe:
        assert ref["dropped"] > 0, "capacity dropped no token copy"
    if case.balancing:
        assert any(b.abs().max() > 0 for step in ref["expert_bias"] for b in step.values()), "the bias never moved"


def test_stage_whose_experts_get_no_tokens(world4):
    case, ranks = world4["empty_experts"]
    assert_parity(case, ranks, dp=2)
    for r in ranks:
        for step in range(case.steps):
            for name, g in r["grads"][step].items():
                if ".experts." not in name:
                    continue
                layer = int(name.split(".")[1])
                if layer >= case.empty_experts_from_layer:
                    assert torch.count_nonzero(g[2:]) == 0, name  # the second ep rank's experts
                assert torch.count_nonzero(g[:2]) > 0, name


def test_stage_timings_are_reported(world4):
    _, ranks = world4["pp2_dp2"]
    m = ranks[0]["metrics"]
    for stage in (0, 1):
        assert m[f"pp_time/stage{stage}_forward"] > 0
        assert m[f"pp_time/stage{stage}_backward"] > 0
    assert m["pp_time/rank0_step"] >= m["pp_time/stage0_forward"] + m["pp_time/stage0_backward"]
