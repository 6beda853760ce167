"""``moetrain plan``'s tensor-parallel choices: dense-part states per rank and tp collective bytes,
against numbers worked out by hand, and the advice to use tp when the dense part does not fit."""

from moetrain.config.loader import load_config
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.plan.model_states import param_specs
from moetrain.plan.plan_table import format_plan
from moetrain.plan.planner import make_plan
from moetrain.plan.tensor_parallel import is_tp_split, tp_advice, tp_bytes_per_micro_batch, tp_choices

# Dense, 2 blocks, D 64, 4 heads, FFN 256 (gelu), V 256, untied head.
MODEL = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, max_seq_len=32, moe_every=0)


def test_which_parameters_tp_splits():
    split = [s.name for s in param_specs(MODEL, MoEConfig()) if is_tp_split(s)]
    assert split == ["tok_embeddings.weight"] + [f"layers.{i}.{w}.weight" for i in range(2)
                                                 for w in ("attention.wq", "attention.wk", "attention.wv",
                                                           "attention.wo", "feed_forward.w1", "feed_forward.w2")] \
        + ["output.weight"]


def test_bytes_by_hand():
    # X = B * S * D * 4 bytes = 2 * 32 * 64 * 4 = 16384. Forward: 2 attention + 2 FFN (all-gather,
    # reduce-scatter) pairs, the embedding's reduce-scatter and the head input's all-gather; the
    # backward as many: 10 all-gathers and 10 reduce-scatters of X, each rank sending half (tp 2),
    # plus the logits' all-gather (2 * 32 * 256 * 4 = 65536 bytes, half sent).
    ag, rs, layer = tp_bytes_per_micro_batch(MODEL, tp=2, micro_batch_size=2, seq_len=32, compute_bytes=4)
    assert (ag, rs) == ((10 * 16384 + 65536) // 2, 10 * 16384 // 2) == (114688, 81920)
    assert layer == 8 * 16384 // 2  # attention + FFN: 4 collectives forward, 4 backward
    # tp 4 sends 3/4; full recompute adds the 4 block pairs again.
    ag4, rs4, _ = tp_bytes_per_micro_batch(MODEL, tp=4, micro_batch_size=2, seq_len=32, compute_bytes=4,
                                           recompute_blocks=4)
    assert (ag4, rs4) == ((14 * 16384 + 65536) * 3 // 4, 14 * 16384 * 3 // 4)
    assert tp_bytes_per_micro_batch(MODEL, tp=1, micro_batch_size=2, seq_len=32, compute_bytes=4) == (0, 0, 0)


def test_states_and_advice():
    specs = param_specs(MODEL, MoEConfig())
    # Split: embedding 16384 + head 16384 + 2 x (4 x 4096 + 2 x 16384) = 131072 elements, 16 bytes
    # each; not split: 5 norms of 64.
    free = tp_choices(specs, MODEL, per_node=4, micro_batch_size=2, seq_len=32, grad_accum=3, compute_bytes=4)
    assert [c.tp for c in free] == [1, 2, 4]
    assert [c.dense_state_bytes for c in free] == [131072 * 16, 65536 * 16, 32768 * 16]
    assert all(c.other_state_bytes == 5 * 64 * 16 for c in free)
    assert (free[1].all_gather_bytes, free[1].reduce_scatter_bytes) == (3 * 114688, 3 * 81920)  # 3 micro-batches
    assert tp_advice(free) is None  # no device memory given
    tight = tp_choices(specs, MODEL, per_node=4, micro_batch_size=2, seq_len=32, grad_accum=1, compute_bytes=4,
                       device_memory=65536 * 16 + 5120)
    assert [c.fits for c in tight] == [False, True, True]
    assert tp_advice(tight).startswith("the dense part does not fit at tp=1: use parallel.tp=2")
    # 4 heads: tp 8 cannot split them.
    eight = tp_choices(specs, MODEL, per_node=8, micro_batch_size=2, seq_len=32, grad_accum=1, compute_bytes=4)
    assert not eight[-1].valid and "must divide model.num_heads (4)" in eight[-1].reason


def test_plan_lists_tp_choices():
    cfg = load_config(None, ["model.dim=64", "model.num_layers=2", "model.num_heads=4", "model.moe_every=0",
                             "data.seq_len=32", "model.max_seq_len=32", "train.global_batch_size=8",
                             "train.micro_batch_size=2"])
    plan = make_plan(cfg, nproc=4, stages=(0,), offloads=("none",), acs=("none",))
    assert [c.tp for c in plan.tp_rows] == [1, 2, 4]
    assert "tensor parallelism" in format_plan(plan) and plan.to_dict()["tensor_parallel"][1]["tp"] == 2
