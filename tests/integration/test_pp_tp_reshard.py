"""A checkpoint saved by one plain process loads into pp=2 x tp=2 (4 gloo processes: each stage's
attention and embedding split over tp, the experts sharded over ep = 2 folded onto the tp ranks,
the optimizer state sliced by ZeRO-1), model and AdamW state; the next step there gives the loss
and parameters of the uninterrupted one-process run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moetrain.distributed.data_parallel.ddp import wrap_optimizer
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.pipeline.stages import build_pipeline_model, parallelize_pipeline
from moetrain.train.checkpoint.state import load_checkpoint, save_checkpoint
from moetrain.train.pipeline_step import PipelineStep
from tests.distributed.workers.pipeline_worker import SEQ, PPCase, _full, build_model, make_batches
from tests.helpers.dist_launcher import run_ranks

pytestmark = pytest.mark.slow

CASE = PPCase("reshard", tp=2, ep=2, zero_stage=1, steps=3)
SAVED_AT = 2


def one_process(folder: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: every step's ``loss + aux`` summed over micro-batches; checkpoint at SAVED_AT."""
    model = build_model(CASE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    M, B = CASE.micro_batches, CASE.micro_batch_size
    losses = []
    for i, (ids_DXS, labels_DXS) in enumerate(make_batches(CASE, 1)):
        if i == SAVED_AT and folder is not None:
            save_checkpoint(folder, i, model=model, optimizer=opt, trainer_state={"step": i})
        total = 0.0
        for m in range(M):
            out = model(ids_DXS[0, m * B:(m + 1) * B], labels_DXS[0, m * B:(m + 1) * B])
            ((out.loss + out.aux_loss) / M).backward()
            total += (out.loss + out.aux_loss).item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined_tp(rank: int, world: int, folder: str) -> dict:
    dims = ParallelDims(world_size=world, ep=CASE.ep, pp=CASE.pp, tp=CASE.tp, num_experts=4)
    dims.build_mesh("cpu")
    pm = build_pipeline_model(build_model(CASE), pp_rank=dims.pp_rank, pp=CASE.pp, seq_len=SEQ)
    parallelize_pipeline(pm, dims, zero_stage=CASE.zero_stage)
    step = PipelineStep(pm, dims, schedule="1f1b", num_microbatches=CASE.micro_batches, device=torch.device("cpu"))
    opt = wrap_optimizer(torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1), dims, zero_stage=1)
    loaded = load_checkpoint(f"{folder}/step_{SAVED_AT:09d}", model=pm, optimizer=opt, pipeline_group=dims.group("pp"))
    ids_DXS, labels_DXS = make_batches(CASE, 1)[SAVED_AT]
    loss, aux = step.forward_backward(ids_DXS[0], labels_DXS[0])
    opt.step()
    params = {n: _full(p.detach()).clone() for n, p in pm.named_parameters()}
    layouts = {n: str(getattr(p, "placements", "plain")) for n, p in pm.named_parameters()}
    dist.barrier()
    return {"step": loaded.step, "loss": float(loss + aux), "params": params, "layouts": layouts}


def test_world1_checkpoint_resumes_at_pp2_tp2(tmp_path):
    losses, want = one_process(str(tmp_path))
    ranks = run_ranks(pipelined_tp, 4, str(tmp_path), timeout_s=180)
    seen = set()
    for r in ranks:
        assert r["step"] == SAVED_AT
        assert r["loss"] == pytest.approx(losses[SAVED_AT], rel=1e-5)
        for name, p in r["params"].items():
            torch.testing.assert_close(p, want[name], atol=2e-6, rtol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(want)
    # It really was split: attention over tp, the embedding by vocabulary rows, experts over ep.
    layouts = {**ranks[0]["layouts"], **ranks[2]["layouts"]}
    assert layouts["tok_embeddings.weight"] == "(Shard(dim=0),)"
    assert layouts["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert layouts["layers.3.feed_forward.experts.w1"] == "(Shard(dim=0),)"
    assert layouts["output.weight"] == "(Shard(dim=0),)"
