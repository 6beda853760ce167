"""LoRA under expert parallelism (2 gloo processes, ep = 2) against one plain process with the
same global batch and weights: loss, gradient norm, every adapter gradient and every adapter after
three clipped AdamW steps within 1e-5 relative, base weights untouched, at ZeRO stages 0 and 1.
The routed experts' adapters are DTensors sharded with their experts; the ep=2 DCP checkpoint
loads into one plain process as the reference's model (the adapters reshard like the experts).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moetrain.distributed import is_expert_shard
from tests.distributed.workers.ep_parity import _assemble, assert_rel_close
from tests.distributed.workers.lora_parity import build_lora_model, lora_worker, run_reference
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _compare(per_rank: list[dict], expected: dict, what: str) -> None:
    assert set(per_rank[0]) == set(expected), f"{what}: names differ"
    for name, (_, exp) in expected.items():
        if per_rank[0][name][0] is None:
            for r, d in enumerate(per_rank):
                assert_rel_close(d[name][1], exp, f"{what} {name} on rank {r}")
        else:
            (full,) = _assemble(per_rank, name, ep=len(per_rank))
            assert_rel_close(full, exp, f"{what} {name}")


def _check(results: list[dict], ref: dict, stage: int) -> None:
    W = len(results)
    for s, ref_step in enumerate(ref["steps"]):
        at = f"[zero {stage}, step {s}]"
        loss = sum(r["steps"][s]["loss"] for r in results) / W
        assert_rel_close(torch.tensor(loss), torch.tensor(ref_step["loss"]), f"{at} loss")
        for r in results:
            assert_rel_close(torch.tensor(r["steps"][s]["norm"]), torch.tensor(ref_step["norm"]), f"{at} grad norm")
        assert ref_step["norm"] > 0.05, "clipping must act"
        _compare([r["steps"][s]["grads"] for r in results], ref_step["grads"], f"{at} grad")
    _compare([r["params"] for r in results], ref["params"], f"[zero {stage}] after {len(ref['steps'])} steps")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the plain-process load
def test_lora_ep2_matches_single_process(tmp_path):
    ref = run_reference(2)
    base = build_lora_model()
    for name, p in base.named_parameters():  # the base weights the reference never moved
        if not p.requires_grad:
            assert torch.equal(ref["params"][name][1], p.detach()), name
    for stage in (0, 1):
        checkpoint = str(tmp_path) if stage == 0 else None
        results = run_ranks(lora_worker, 2, 2, stage, checkpoint=checkpoint, timeout_s=150)
        # The routed experts' adapters really are sharded over ep, two experts per rank.
        for r, expected in zip(results, (0, 2), strict=True):
            offsets = {off for name, (off, _) in r["params"].items() if ".experts.lora_" in name}
            assert offsets == {expected}, offsets
        _check(results, ref, stage)

    # The ep=2 save (experts and adapters as DTensors) loads into one plain LoRA model.
    plain = build_lora_model(seed=9)
    state = plain.state_dict()
    assert not any(is_expert_shard(t) for t in state.values())
    dcp.load(state, checkpoint_id=str(tmp_path))
    for name, value in state.items():
        assert_rel_close(value, ref["params"][name][1], f"checkpoint {name}")
