"""Checkpoints reshard between tensor-parallel layouts and one process (DCP resharding of the DTensor
tp shards, the sequence-parallel norm weights and the ep-sharded experts), model and optimizer
state: tp=2 x ep=2 (folded, world 2) -> world 1, world 1 -> tp=2, and the same with the experts'
hidden dim split over etp = 2. The loaded state equals the saved one exactly, and the next steps'
losses equal those of the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.workers.tp_parity import TpRun, build, make_batches
from tests.helpers.dist_launcher import run_ranks
from tests.integration.test_checkpoint import _assert_same_state, save_or_resume

RUN = TpRun("reshard", tp=1, steps=6)


def _tp_run(rank: int, world_size: int, tp: int, ep: int, ckpt_dir: str, save: bool, etp: int = 1) -> dict | None:
    """3 steps then save (``save``) or load step 3; then 3 more steps. Returns (rank 0) the full
    state right after the save or load and the losses of the 3 steps after it."""

    import torch.distributed as dist

    from moetrain.distributed import ParallelDims, parallelize
    from moetrain.train.optim import build_optimizer

    dims = ParallelDims(world_size=world_size, tp=tp, ep=ep, etp=etp, num_experts=4)
    dims.build_mesh("cpu")
    model = build(RUN)
    train_model = parallelize(model, dims)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    batches = make_batches(RUN)
    B = batches.shape[1] // dims.dp

    def train(first: int, last: int) -> list[float]:
        losses = []
        for step in range(first, last):
            batch = batches[step, dims.dp_rank * B:(dims.dp_rank + 1) * B]
            out = train_model(batch[:, :-1], batch[:, 1:])
            out.total_loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = out.total_loss.detach().clone()
            if dims.dp > 1:
                dist.all_reduce(loss, group=dims.group("dp"))
            losses.append(loss.item() / dims.dp)
        return losses

    return save_or_resume(rank, model, optimizer, train, ckpt_dir, save=save)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tp2_ep2_to_world1_and_world1_to_tp2(tmp_path):
    folded = str(tmp_path / "tp2_ep2")
    saved = run_ranks(_tp_run, 2, 2, 2, folded, True, timeout_s=60)[0]
    got = run_ranks(_tp_run, 1, 1, 1, folded, False, timeout_s=60)[0]
    _assert_same_state(got["state"], saved["state"])
    assert got["losses"] == pytest.approx(saved["losses"], rel=2e-5)

    single = str(tmp_path / "world1")
    saved = run_ranks(_tp_run, 1, 1, 1, single, True, timeout_s=60)[0]
    got = run_ranks(_tp_run, 2, 2, 1, single, False, timeout_s=60)[0]
    _assert_same_state(got["state"], saved["state"])
    assert got["losses"] == pytest.approx(saved["losses"], rel=2e-5)
    assert all(torch.isfinite(torch.tensor(got["losses"])))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_expert_tensor_parallel_to_world1_and_back(tmp_path):
    """Experts split over (ep, etp): tp=2 x etp=2 (world 2) -> world 1, and world 1 -> dp=2 x etp=2."""
    split = str(tmp_path / "tp2_etp2")
    saved = run_ranks(_tp_run, 2, 2, 1, split, True, 2, timeout_s=60)[0]
    got = run_ranks(_tp_run, 1, 1, 1, split, False, timeout_s=60)[0]
    _assert_same_state(got["state"], saved["state"])
    assert got["losses"] == pytest.approx(saved["losses"], rel=2e-5)

    single = str(tmp_path / "world1")
    saved = run_ranks(_tp_run, 1, 1, 1, single, True, timeout_s=60)[0]
    got = run_ranks(_tp_run, 2, 1, 1, single, False, 2, timeout_s=60)[0]
    _assert_same_state(got["state"], saved["state"])
    assert got["losses"] == pytest.approx(saved["losses"], rel=2e-5)
