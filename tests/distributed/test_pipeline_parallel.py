"""Pipeline parallelism against one process holding the global batch (gloo, real processes).

Every case compares, at every step, the loss and aux-loss sums (mean over the dp ranks), the
clipped-or-not global gradient norm and every gradient of every stage (expert and FSDP shards
gathered to full tensors), and the parameters after three AdamW steps, with the one-process run
of ``tests.distributed.pipeline_worker.run_reference`` (the same micro-batches accumulated).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.dist_launcher import run_ranks
from tests.distributed.pipeline_worker import PPCase, run_cases, run_reference

pytestmark = pytest.mark.slow

ATOL = 2e-6

WORLD2 = [PPCase("gpipe", schedule="gpipe"), PPCase("1f1b", max_grad_norm=0.5),
          PPCase("interleaved", schedule="interleaved_1f1b", virtual_stages=2),
          # Aux-loss gradient: z-loss alone is a mean over tokens, so its gradient is the same for
          # any cut of the step into micro-batches; aux coefficients 0 give the other runs' part.
          PPCase("z_m2", moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.5}, micro_batches=2, micro_batch_size=4),
          PPCase("z_m4", moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.5}, micro_batches=4, micro_batch_size=2),
          PPCase("noaux_m2", moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0}, micro_batches=2, micro_batch_size=4),
          PPCase("noaux_m4", moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0}, micro_batches=4, micro_batch_size=2)]
WORLD4 = [PPCase("pp2_ep2", ep=2), PPCase("pp2_dp2", max_grad_norm=0.5),
          PPCase("pp2_ep2_zero2", ep=2, zero_stage=2, max_grad_norm=0.5),
          PPCase("empty_experts", ep=2, empty_experts_from_layer=2)]


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


def test_aux_loss_gradient_does_not_depend_on_micro_batches(world2):
    grads = {}
    for name in ("z_m2", "z_m4", "noaux_m2", "noaux_m4"):
        case, ranks = world2[name]
        assert_parity(case, ranks, dp=1)
        grads[name] = {k: v for r in ranks for k, v in r["grads"][0].items()}
    aux_m2 = {k: grads["z_m2"][k] - grads["noaux_m2"][k] for k in grads["z_m2"]}
    aux_m4 = {k: grads["z_m4"][k] - grads["noaux_m4"][k] for k in grads["z_m4"]}
    routers = [k for k in aux_m2 if "router" in k]
    assert routers and all(aux_m2[k].abs().max() > 1e-4 for k in routers)
    for k, expected in aux_m2.items():
        torch.testing.assert_close(aux_m4[k], expected, atol=1e-6, rtol=1e-4, msg=k)


@pytest.mark.parametrize("name", ["pp2_ep2", "pp2_dp2", "pp2_ep2_zero2"])
def test_pp2_hybrids_match_one_process(world4, name):
    case, ranks = world4[name]
    assert_parity(case, ranks, dp=2)
    assert [r["stage_ids"] for r in ranks] == [[0], [0], [1], [1]]


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
