"""A checkpoint saved at pp=2 x ep=2 (4 gloo processes: each stage holds its blocks, experts
sharded over ep) loads into one plain process, model and AdamW state, and the next step there
gives the loss and parameters of the uninterrupted pipelined run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.pipeline.stages import build_pipeline_model, parallelize_pipeline
from moetrain.train.checkpoint.state import load_checkpoint, save_checkpoint
from moetrain.train.pipeline_step import PipelineStep
from tests.distributed.workers.pipeline_worker import SEQ, PPCase, _full, build_model, make_batches
from tests.helpers.dist_launcher import run_ranks

pytestmark = pytest.mark.slow

CASE = PPCase("reshard", ep=2, steps=3)
SAVED_AT = 2


def pipelined(rank: int, world: int, folder: str) -> dict:
    dims = ParallelDims(world_size=world, ep=CASE.ep, pp=CASE.pp)
    dims.build_mesh("cpu")
    pm = build_pipeline_model(build_model(CASE), pp_rank=dims.pp_rank, pp=CASE.pp, seq_len=SEQ)
    parallelize_pipeline(pm, dims)
    step = PipelineStep(pm, dims, schedule="1f1b", num_microbatches=CASE.micro_batches, device=torch.device("cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses = []
    for i, (ids_DXS, labels_DXS) in enumerate(make_batches(CASE, dims.dp)):
        if i == SAVED_AT:
            save_checkpoint(folder, i, model=pm, optimizer=opt, trainer_state={"step": i})
        loss, aux = step.forward_backward(ids_DXS[dims.dp_rank], labels_DXS[dims.dp_rank])
        losses.append(float(loss + aux))
        opt.step()
        opt.zero_grad()
    params = {n: _full(p.detach()).clone() for n, p in pm.named_parameters()}
    dist.barrier()
    return {"losses": losses, "params": params, "dp_rank": dims.dp_rank}


def test_pp2_ep2_checkpoint_resumes_in_one_process(tmp_path):
    ranks = run_ranks(pipelined, 4, str(tmp_path), timeout_s=120)
    model = build_model(CASE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loaded = load_checkpoint(tmp_path / f"step_{SAVED_AT:09d}", model=model, optimizer=opt)
    assert loaded.step == SAVED_AT
    # The resumed one-process step: the global micro-batches of step SAVED_AT.
    ids_DXS, labels_DXS = make_batches(CASE, 2)[SAVED_AT]
    M, B = CASE.micro_batches, CASE.micro_batch_size
    total = 0.0
    for m in range(M):
        out = model(ids_DXS[:, m * B:(m + 1) * B].reshape(-1, SEQ), labels_DXS[:, m * B:(m + 1) * B].reshape(-1, SEQ))
        ((out.loss + out.aux_loss) / M).backward()
        total += (out.loss + out.aux_loss).item()
    opt.step()
    # Each pp rank reports the sums over its dp slice; the one-process sum is their mean over dp.
    by_dp = {r["dp_rank"]: r for r in ranks}
    assert total == pytest.approx((by_dp[0]["losses"][SAVED_AT] + by_dp[1]["losses"][SAVED_AT]) / 2, rel=1e-5)
    seen = set()
    for r in ranks:
        for name, p in r["params"].items():
            torch.testing.assert_close(dict(model.named_parameters())[name].detach(), p, atol=2e-6, rtol=1e-5,
                                       msg=name)
            seen.add(name)
    assert seen == {n for n, _ in model.named_parameters()}
