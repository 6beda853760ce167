"""Checkpoints under ZeRO (see test_checkpoint.py for the rest): a ZeRO-3 checkpoint resharded to
ZeRO-0 and ZeRO-2 at other worlds and expert-parallel degrees, and a ZeRO-1 checkpoint that holds
exactly the stage-0 state and loads at any layout.

References are independent of the checkpoint code: full weights and Adam moments are read from
the live model and optimizer (``test_checkpoint._full_state``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist_launcher import run_ranks
from tests.integration.test_checkpoint import E, _assert_same_state, save_or_resume

# The ZeRO layouts are driven by a plain loop over the model, optimizer and checkpoint
# functions the trainer uses: one loop runs any (world, ep, zero) on random tokens, with no data
# position to keep in step across layouts. The trainer itself at ep=2 x zero=3, checkpoint and
# resume included, is run through the command line in test_cli_zero3.py.


def _zero_run(rank: int, world_size: int, ep: int, zero_stage: int, ckpt_dir: str,
              save: bool) -> dict | None:
    """(world, ep, zero): 3 steps then save (``save``), or load step 3; then 3 more steps. Returns
    (rank 0) the full state after the save or load and the losses of the 3 steps after it."""
    import torch.distributed as dist

    from moetrain.config.model import ModelConfig
    from moetrain.config.moe import MoEConfig
    from moetrain.distributed.data_parallel.ddp import wrap_optimizer
    from moetrain.distributed.parallel_dims import ParallelDims
    from moetrain.distributed.parallelize import parallelize
    from moetrain.models.transformer import Transformer
    from moetrain.train.optim import build_optimizer

    dims = ParallelDims(world_size=world_size, ep=ep, num_experts=E)
    dims.build_mesh("cpu")
    model = Transformer(ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, max_seq_len=64),
                        moe=MoEConfig(num_experts=E, top_k=2, expert_hidden_dim=64), seed=0)
    train_model = parallelize(model, dims, zero_stage=zero_stage)
    optimizer = wrap_optimizer(build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8),
                               dims, zero_stage=zero_stage)
    tokens = torch.randint(0, 256, (6, 8, 65), generator=torch.Generator().manual_seed(0))

    def train(first: int, last: int) -> list[float]:
        losses, per_rank = [], 8 // dims.dp
        for step in range(first, last):
            batch = tokens[step, dims.dp_rank * per_rank:(dims.dp_rank + 1) * per_rank]
            out = train_model(batch[:, :-1], batch[:, 1:])
            out.total_loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = out.loss.detach().clone()
            if dims.dp > 1:
                dist.all_reduce(loss)
            losses.append(loss.item() / dims.dp)
        return losses

    return save_or_resume(rank, model, optimizer, train, ckpt_dir, save=save)


def _zero_runs(rank: int, world_size: int, runs: list[tuple]) -> list[dict | None]:
    """Several ``_zero_run`` in one process start; the barrier: a load after a save sees all of it."""
    import torch.distributed as dist

    out = []
    for run in runs:
        out.append(_zero_run(rank, world_size, *run))
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_reshard_zero3_checkpoint_to_zero0_single_process_and_zero2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # (world 4, ep 2, zero 3) saves; (world 4, ep 4, zero 2) loads in the same process start.
    saved, at_ep4 = run_ranks(_zero_runs, 4, [(2, 3, ckpt, True), (4, 2, ckpt, False)], timeout_s=120)[0]
    for world, ep, zero in ((2, 2, 0), (1, 1, 0), (4, 4, 2)):
        got = at_ep4 if world == 4 else run_ranks(_zero_run, world, ep, zero, ckpt, False, timeout_s=120)[0]
        _assert_same_state(got["state"], saved["state"])
        assert got["losses"] == pytest.approx(saved["losses"], rel=1e-5), (world, ep, zero)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_zero1_checkpoint_is_the_stage0_state_and_loads_at_any_layout(tmp_path):
    # ZeRO-1 slices the optimizer state element-wise over dp (dense) and edp (experts); AdamW is
    # element-wise, so at step 3 it holds exactly what stage 0 holds at the same layout.
    ckpt = str(tmp_path / "zero1")
    # World 4, ep 2 (dp 2, edp 2), one process start: stage 0 saves, ZeRO-1 saves, ZeRO-1 loads.
    stage0, _, zero1_again = run_ranks(_zero_runs, 4, [(2, 0, str(tmp_path / "stage0"), True),
                                                       (2, 1, ckpt, True), (2, 1, ckpt, False)], timeout_s=120)[0]
    # Read back in one process at stage 0: the whole state, compared with the stage-0 run's own.
    single = run_ranks(_zero_run, 1, 1, 0, ckpt, False, timeout_s=120)[0]
    _assert_same_state(single["state"], stage0["state"])
    assert single["losses"] == pytest.approx(stage0["losses"], rel=1e-5)
    # Into ZeRO-1 again, at the saving layout and at another one: training continues the same.
    for world, ep in ((4, 2), (2, 1)):
        got = zero1_again if world == 4 else run_ranks(_zero_run, world, ep, 1, ckpt, False, timeout_s=120)[0]
        assert got["losses"] == pytest.approx(stage0["losses"], rel=1e-5), (world, ep)
        params = {k: v for k, v in stage0["state"].items() if k.startswith(("param/", "lr/"))}
        _assert_same_state({k: v for k, v in got["state"].items() if k in params}, params)
