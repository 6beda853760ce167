"""``moe.force_balance`` under expert parallelism, on real gloo processes, against one plain
process with the same global batch and weights (ep_parity.py): outputs, losses, aux losses, every
gradient and the parameters after several AdamW steps, within 1e-5 relative (fp32).

"round_robin" sends copy ``n = t * K + j`` of a forward to expert ``n mod E``, ``t`` counting that
forward's own tokens, so each rank's pattern starts over at its first token. The ranks then route
as the global batch does exactly when E divides every forward's T * K: 16 tokens x top-2 = 32
copies per rank over E = 8 here (8 x 2 per micro-batch when accumulating). "random" draws each
forward's assignment from the RNG for that forward's tokens, so it depends on how the batch is cut
and is not compared (README, "Routing and load balancing").
"""

import pytest
import torch

from moetrain.models.moe.router import forced_assignment
from tests.distributed.workers.ep_parity import Case, assert_parity, parity_worker, run_reference
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ROUND_ROBIN = {"force_balance": "round_robin"}
FORCED = Case("force_round_robin", moe=ROUND_ROBIN)
FORCED_DEDUP = Case("force_round_robin_dedup", moe={**ROUND_ROBIN, "dispatch_dedup": True})
# Two micro-batches of 8 tokens per rank, each forward recomputed in backward (the assignment is
# stateless, so the recomputed forward routes alike).
FORCED_ACCUMULATE_AC = Case("force_round_robin_accumulate_ac", moe=ROUND_ROBIN, micro_batches=2,
                            activation_checkpointing=True)
NUM_EXPERTS, TOP_K = 8, 2  # ep_parity's MoE


def _check(cases, results, ep: int, world_size: int) -> None:
    for case in cases:
        ranks = [r[f"ep{ep}/{case.name}"] for r in results]
        ref = run_reference(case, world_size)
        assert_parity(case, ranks, ref, ep=ep)
        _check_routing_is_forced(case, ranks, ref, world_size)


def _check_routing_is_forced(case, ranks, ref, world_size: int) -> None:
    """Guard the harness: every forward sends each expert exactly its share of the global batch's
    copies (the ranks report counts summed over the balance group, as the reference counts them),
    while the router left alone would not."""
    share = world_size * case.tokens_per_rank // case.micro_batches * TOP_K // NUM_EXPERTS
    for who, run in [("reference", ref), *((f"rank {r}", run) for r, run in enumerate(ranks))]:
        for s, step in enumerate(run["steps"]):
            for m, layers in enumerate(step["routed"]):
                assert all(counts == [share] * NUM_EXPERTS for counts in layers), (who, s, m, layers)
    free = Case(case.name + "_free", moe={k: v for k, v in case.moe.items() if k != "force_balance"},
                micro_batches=case.micro_batches, activation_checkpointing=case.activation_checkpointing)
    routed = run_reference(free, world_size)["steps"][0]["routed"][0]
    assert any(len(set(counts)) > 1 for counts in routed), f"the router alone routes evenly: {routed}"


def test_round_robin_starts_over_at_every_forward():
    """Why layout-invariance needs E | T*K: two halves routed apart equal the whole routed at once
    only then."""
    def halves(tokens: int) -> torch.Tensor:
        half = forced_assignment(tokens // 2, NUM_EXPERTS, TOP_K, mode="round_robin")
        return torch.cat([half, half])

    whole = forced_assignment(32, NUM_EXPERTS, TOP_K, mode="round_robin")
    assert torch.equal(halves(32), whole)  # 16 * 2 copies per half: a multiple of 8
    assert not torch.equal(halves(10), forced_assignment(10, NUM_EXPERTS, TOP_K, mode="round_robin"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the plain-process reference
def test_round_robin_ep2_world2_matches_single_process():
    cases = [FORCED, FORCED_DEDUP, FORCED_ACCUMULATE_AC]
    _check(cases, run_ranks(parity_worker, 2, [(2, cases)], timeout_s=120), ep=2, world_size=2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_round_robin_dp2_ep2_world4_matches_single_process():
    cases = [FORCED]
    _check(cases, run_ranks(parity_worker, 4, [(2, cases)], timeout_s=120), ep=2, world_size=4)
