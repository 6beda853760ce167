"""``plan_pipeline``'s parameters per pp rank against the stages ``build_pipeline_model`` gives
that rank: the last stage holds the final norm, the head, the multi-token modules and, where they
read it or the head is tied to it, a copy of the embedding."""

from dataclasses import replace

import pytest
import torch

from moetrain.config.presets import get_preset
from moetrain.distributed.pipeline.stages import build_pipeline_model
from moetrain.models.transformer import Transformer
from moetrain.plan.pipeline import plan_pipeline


def _meta_model(**overrides) -> Transformer:
    p = get_preset("tiny")
    with torch.device("meta"):
        return Transformer(replace(p.model, vocab_size=4096, preset=None, **overrides), moe=p.moe)


# Before the multi-token modules were counted the planner gave the last rank 1,706,624 parameters at
# mtp_depth 2 where its stage holds 3,479,424.
@pytest.mark.parametrize("mtp_depth,tie,virtual_stages,split", [(2, False, 1, "layers"), (1, True, 1, "layers"),
                                                                 (2, False, 2, "params"), (0, True, 1, "layers")])
def test_planned_params_per_rank_are_the_built_stages(mtp_depth, tie, virtual_stages, split):
    overrides = dict(mtp_depth=mtp_depth, tie_embeddings=tie)
    plan = plan_pipeline(_meta_model(**overrides), pp=2, schedule="1f1b", num_microbatches=2,
                         virtual_stages=virtual_stages, split=split, micro_batch_size=1, seq_len=64,
                         saved_bytes_per_microbatch=0, head_bytes_per_microbatch=0)
    for r, planned in enumerate(plan.ranks):
        stage = build_pipeline_model(_meta_model(**overrides), pp_rank=r, pp=2, virtual_stages=virtual_stages,
                                     split=split, seq_len=64, device=torch.device("meta"))
        held = sum(p.numel() for p in {id(p): p for p in stage.parameters()}.values())
        assert planned.params == held, f"pp rank {r}: planned {planned.params:,}, its stages hold {held:,}"
