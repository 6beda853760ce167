"""LoRA under pipeline parallelism with the embedding shared by the first and the last stage (tied
head, or the multi-token modules' embedding): the frozen embedding has no gradient to sum over the
two stages, and the adapters' gradients of a pp = 2 step equal one process's (the same model, LoRA
adapters and micro-batches). The embedding all-reduce used to assert on the missing gradient."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.finetune import FinetuneConfig
from moetrain.models.lora import apply_lora
from tests.distributed.workers.pipeline_worker import PPCase, build_model, make_batches
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CASES = [PPCase("lora_tied", model={"tie_embeddings": True}, steps=1),
         PPCase("lora_mtp", model={"mtp_depth": 1}, steps=1)]
LORA = FinetuneConfig(lora_rank=2)


def _model(case: PPCase):
    model = build_model(case)
    apply_lora(model, LORA, seed=0)
    return model


def _stage_grads(rank, world_size, cases):
    from moetrain.distributed.parallel_dims import ParallelDims
    from moetrain.distributed.pipeline.stages import build_pipeline_model, parallelize_pipeline
    from moetrain.train.pipeline_step import PipelineStep
    from tests.distributed.workers.pipeline_worker import SEQ

    dims = ParallelDims(world_size=world_size, pp=2)
    dims.build_mesh("cpu")
    out = {}
    for case in cases:
        pm = build_pipeline_model(_model(case), pp_rank=dims.pp_rank, pp=2, seq_len=SEQ, device=torch.device("cpu"))
        parallelize_pipeline(pm, dims)
        step = PipelineStep(pm, dims, schedule="1f1b", num_microbatches=case.micro_batches, device=torch.device("cpu"))
        ids, labels = make_batches(case, 1)[0]
        loss, _ = step.forward_backward(ids[0], labels[0])
        step._sum_shared_embedding_grad()
        out[case.name] = {"loss": float(loss), "grads": {n: p.grad.clone() for n, p in pm.named_parameters()
                                                         if p.requires_grad}}
    return out


def _reference(case: PPCase) -> tuple[float, dict[str, torch.Tensor]]:
    """One process: the mean over the micro-batches of (lm + aux + multi-token losses)."""
    model = _model(case)
    ids, labels = make_batches(case, 1)[0]
    B, M = case.micro_batch_size, case.micro_batches
    lm = 0.0
    for m in range(M):
        out = model(ids[0, m * B:(m + 1) * B], labels[0, m * B:(m + 1) * B])
        objective = out.loss + out.aux_loss + (out.mtp_loss if out.mtp_loss is not None else 0.0)
        (objective / M).backward()
        lm += float(out.loss) / M
    return lm, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_lora_adapters_train_under_pp_with_a_shared_embedding():
    results = run_ranks(_stage_grads, 2, CASES, timeout_s=100)
    for case in CASES:
        lm, want = _reference(case)
        got = {n: g for r in results for n, g in r[case.name]["grads"].items()}
        assert got.keys() == want.keys() and any("lora" in n for n in got), case.name
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=f"{case.name} {name}")
        assert results[0][case.name]["loss"] / case.micro_batches == pytest.approx(lm, rel=1e-6)
