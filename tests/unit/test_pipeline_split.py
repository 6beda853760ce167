"""Pipeline stage split, stage modules, planning arithmetic and config rules (one process)."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.config.pipeline import check_microbatches, check_pipeline_model
from moetrain.distributed.pipeline.stages import (
    build_pipeline_model,
    layer_costs,
    rank_stage_ids,
    split_stages,
)
from moetrain.models.transformer import Transformer
from moetrain.plan.pipeline import bubble_fraction, microbatches_in_flight, p2p_bytes_per_step, plan_pipeline
from moetrain.train.pipeline_step import merge_layer_metrics


def tiny(num_layers: int = 4, **model) -> Transformer:
    cfg = ModelConfig(vocab_size=64, dim=16, num_layers=num_layers, num_heads=2, max_seq_len=8, **model)
    return Transformer(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16), seed=0)


def test_split_by_layers_gives_the_first_stages_the_remainder():
    assert split_stages([1.0] * 4, 2) == [range(2), range(2, 4)]
    assert split_stages([1.0] * 5, 2) == [range(3), range(3, 5)]
    assert split_stages([1.0] * 7, 3) == [range(3), range(3, 5), range(5, 7)]


def test_split_balances_costs_with_the_extras():
    # Costs 1 1 1 1 with a head of 2 on the last stage: [0, 1, 2] | [3] + 2 -> max 3.
    assert split_stages([1.0] * 4, 2, last_extra=2.0) == [range(3), range(3, 4)]
    # An embedding of 3 on the first stage pushes the cut the other way.
    assert split_stages([1.0] * 4, 2, first_extra=3.0) == [range(1), range(1, 4)]
    assert split_stages([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [range(1), range(1, 6)]


def test_split_rejects_more_stages_than_blocks():
    with pytest.raises(ValueError, match=r"pipeline stages \(5"):
        split_stages([1.0] * 4, 5)


def test_layer_costs_count_parameters_and_flops():
    model = tiny(moe_every=2)  # blocks 0, 2 MoE; 1, 3 dense
    costs, first, last = layer_costs(model, "params", seq_len=8)
    assert costs == [float(sum(p.numel() for p in b.parameters())) for b in model.layers]
    assert first == 64 * 16 and last == 64 * 16 + 16
    flops, f_first, f_last = layer_costs(model, "flops", seq_len=8)
    moe_block = model.layers[0]
    expert = sum(p.numel() for p in moe_block.feed_forward.experts.parameters())
    active = costs[0] - expert + expert * 2 // 4
    assert flops[0] == 6 * active + 6 * 2 * (8 + 8) * 8
    assert flops[1] == 6 * costs[1] + 6 * 2 * 16 * 8
    assert (f_first, f_last) == (0.0, 6 * 64 * 16)


def test_the_last_stage_pays_for_the_multi_token_modules():
    """Its parameters hold the modules and the embedding copy (untied head): the split sees the
    parameters the last stage's rank really holds, and the FLOPs of a block, a projection and a head
    pass per depth."""
    model = tiny(num_layers=8, moe_every=2, mtp_depth=2, tie_embeddings=False)
    costs, _, last = layer_costs(model, "params", seq_len=8)
    stage = build_pipeline_model(model, pp_rank=3, pp=4, split="params", seq_len=8)
    held_blocks = sum(costs[int(i)] for i in stage.layers)
    assert held_blocks + last == sum(p.numel() for p in stage.parameters())
    plain = tiny(num_layers=8, moe_every=2, tie_embeddings=False)
    flops, _, f_last = layer_costs(model, "flops", seq_len=8)
    _, _, plain_last = layer_costs(plain, "flops", seq_len=8)
    # A depth: an MoE block (as trunk block 0), the [2D -> D] projection, one more head pass.
    per_depth = flops[0] + 6 * 32 * 16 + plain_last
    assert f_last == plain_last + 2 * per_depth


def test_rank_stage_ids_loop_placement():
    assert rank_stage_ids(0, 2, 2) == [0, 2]
    assert rank_stage_ids(1, 4, 3) == [1, 5, 9]


def test_stage_model_keeps_the_model_names_and_meta_build_draws_the_same_weights():
    full = tiny()
    names = dict(full.named_parameters())
    for rank in (0, 1):
        with torch.device("meta"):
            meta = tiny()  # afresh: materialising a rank's stages materialises those modules
        pm = build_pipeline_model(tiny(), pp_rank=rank, pp=2, virtual_stages=2)
        from_meta = build_pipeline_model(meta, pp_rank=rank, pp=2, virtual_stages=2, device=torch.device("cpu"))
        expected = {"0": ["0", "2"], "1": ["1", "3"]}[str(rank)]
        assert sorted(pm.layers.keys()) == expected
        assert (pm.tok_embeddings is not None) == (rank == 0)
        assert (pm.output is not None) == (rank == 1)
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p, names[name], rtol=0, atol=0)
        meta_params = dict(from_meta.named_parameters())
        assert meta_params.keys() == dict(pm.named_parameters()).keys()
        for name, p in meta_params.items():
            torch.testing.assert_close(p, names[name], rtol=0, atol=0)
        torch.testing.assert_close(from_meta.chunks[-1].rope_cos_SA, full.rope_cos_SA, rtol=0, atol=0)


def test_stages_chained_equal_the_whole_model():
    full = tiny()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    parts = [build_pipeline_model(tiny(), pp_rank=r, pp=2, virtual_stages=2) for r in (0, 1)]
    chunks = sorted((c for pm in parts for c in pm.chunks), key=lambda c: c.stage_id)
    x = ids
    for chunk in chunks:
        x = chunk(x)
    torch.testing.assert_close(x, full(ids).logits, rtol=0, atol=0)


def test_last_stage_holds_a_copy_of_the_shared_embedding():
    """A tied head and the multi-token modules: the last stage holds an embedding named as the first
    stage's, equal to it when both are built on the meta device and initialised by name, and the
    chained stages give the whole model's logits."""
    full = tiny(tie_embeddings=True, mtp_depth=1)
    with torch.device("meta"):
        metas = [tiny(tie_embeddings=True, mtp_depth=1) for _ in (0, 1)]
    parts = [build_pipeline_model(m, pp_rank=r, pp=2, device=torch.device("cpu")) for r, m in enumerate(metas)]
    first, last = parts
    assert not first.holds_embedding_copy and last.holds_embedding_copy
    assert first.mtp is None and last.mtp is not None and "mtp.0.eh_proj.weight" in dict(last.named_parameters())
    for pm in parts:
        torch.testing.assert_close(dict(pm.named_parameters())["tok_embeddings.weight"], full.tok_embeddings.weight,
                                   rtol=0, atol=0)
    assert last.output is not None and last.tok_embeddings is not None
    assert last.output.weight is last.tok_embeddings.weight  # tied again after materialising
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = last.chunks[0](first.chunks[0](ids))
    torch.testing.assert_close(logits, full(ids).logits, rtol=0, atol=0)


def test_pipeline_rejects_classifier_heads():
    with pytest.raises(ValueError, match=r"model.head \('classifier'\) must be 'lm' with parallel.pp \(2\)"):
        check_pipeline_model(ModelConfig(head="classifier", num_classes=3), pp=2)


def test_microbatch_rules_name_the_fields():
    with pytest.raises(ValueError, match=r"'1f1b'\) needs at least parallel.pp \(4\) micro-batches"):
        check_microbatches("1f1b", num_microbatches=2, pp=4)
    with pytest.raises(ValueError, match="multiple of"):
        check_microbatches("interleaved_1f1b", num_microbatches=5, pp=2)
    check_microbatches("gpipe", num_microbatches=1, pp=4)


def test_config_rules():
    ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_split="flops")
    with pytest.raises(ValueError, match=r"parallel.pp_virtual_stages \(1\) must be >= 2"):
        ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")
    with pytest.raises(ValueError,
                       match=r"parallel.pp_virtual_stages \(2\) must be 1 with parallel.pp_schedule 'gpipe'"):
        ParallelConfig(pp=2, pp_schedule="gpipe", pp_virtual_stages=2)
    with pytest.raises(ValueError, match=r"parallel.pp_split \('x'\)"):
        ParallelConfig(pp_split="x")


def test_merge_layer_metrics_orders_by_layer():
    stage0 = (["layers.0.feed_forward", "layers.2.feed_forward"], {"load_cv": [0.1, 0.3], "note": 7})
    stage1 = (["layers.1.feed_forward", "layers.3.feed_forward"], {"load_cv": [0.2, 0.4]})
    assert merge_layer_metrics([stage0, stage1]) == {"load_cv": [0.1, 0.2, 0.3, 0.4], "note": 7}


def test_bubble_and_in_flight_by_hand():
    assert bubble_fraction(pp=4, num_microbatches=8) == pytest.approx(3 / 11)
    assert bubble_fraction(pp=4, num_microbatches=8, virtual_stages=2) == pytest.approx(3 / 19)
    assert bubble_fraction(pp=1, num_microbatches=8) == 0.0
    assert microbatches_in_flight("gpipe", pp=4, pp_rank=0, num_microbatches=8) == 8
    assert [microbatches_in_flight("1f1b", pp=4, pp_rank=r, num_microbatches=8) for r in range(4)] == [4, 3, 2, 1]
    # Megatron's interleaved warm-up: 2 (p - r - 1) + (v - 1) p + 1 chunks of 1/v of the layers.
    assert microbatches_in_flight("interleaved_1f1b", pp=2, pp_rank=0, num_microbatches=4,
                                  virtual_stages=2) == pytest.approx(5 / 2)
    assert microbatches_in_flight("interleaved_1f1b", pp=2, pp_rank=1, num_microbatches=4,
                                  virtual_stages=2) == pytest.approx(3 / 2)


def test_p2p_bytes_by_hand():
    # Micro-batch 2 x 8 x 16 fp32 = 1024 bytes; 4 micro-batches.
    kw = {"num_stages": 4, "num_microbatches": 4, "micro_batch_size": 2, "seq_len": 8, "dim": 16, "dtype_bytes": 4}
    assert p2p_bytes_per_step(stage_ids=[0], **kw) == 4 * 1024  # activations forward only
    assert p2p_bytes_per_step(stage_ids=[1], **kw) == 2 * 4 * 1024  # forward and gradient back
    assert p2p_bytes_per_step(stage_ids=[0, 3], **kw) == 2 * 4 * 1024  # first: forward, last: back


def test_plan_pipeline_splits_the_whole_model():
    with torch.device("meta"):
        model = tiny(num_layers=6)
    plan = plan_pipeline(model, pp=2, schedule="1f1b", num_microbatches=4, micro_batch_size=2, seq_len=8,
                         saved_bytes_per_microbatch=6 * 1000 + 500, head_bytes_per_microbatch=500)
    assert sum(r.params for r in plan.ranks) == sum(p.numel() for p in model.parameters())
    assert [r.layers for r in plan.ranks] == [[0, 1, 2], [3, 4, 5]]
    assert [r.activation_bytes for r in plan.ranks] == [2 * 3 * 1000, 1 * (3 * 1000 + 500)]
    assert plan.bubble_fraction == pytest.approx(1 / 5)
