"""The shrunk job stays valid at every layout verified: heads tp can split, whole layouts checked
by every JobConfig rule before any run (verify/shrink.py, verify/driver.py)."""

from __future__ import annotations

import pytest

from moetrain.config.loader import load_config
from moetrain.verify.driver import plan_verification
from moetrain.verify.layouts import parse_layouts


def _plan(config: str, overrides: list[str], layouts: str):
    return plan_verification(load_config(config, overrides), layouts=parse_layouts(layouts), steps=1, shrink=True,
                             cpu=True)


@pytest.mark.parametrize(("heads", "kv", "layouts", "want"), [
    (32, 8, "tp=2", (8, 2)),   # ratio 4 kept, 2 key/value heads for tp=2 (4/1 before: tp refused it)
    (8, 2, "tp=2", (8, 2)),
    (12, 4, "ep=2", (3, 1)),   # ratio 3 kept (4/1 before)
    (8, 8, "tp=2,ep=2", (4, 4)),
])
def test_shrunk_heads_keep_the_ratio_and_split_over_tp(heads, kv, layouts, want):
    plan = _plan("tiny", [f"--model.num_heads={heads}", f"--model.num_kv_heads={kv}", "--model.head_dim=16"], layouts)
    m = plan.cfg.model
    assert (m.num_heads, m.num_kv_heads) == want
    assert m.num_heads // m.num_kv_heads == heads // kv
    assert all(m.num_kv_heads % lay.tp == 0 for lay in plan.layouts)


@pytest.mark.parametrize(("heads", "kv", "layouts", "want"), [
    (64, 1, "ep=2", (8, 1)),  # multi-query: the ratio capped, else 64 query heads of size 1 (refused)
    (32, 1, "tp=2", (8, 2)),
    (16, 2, "ep=2", (8, 1)),  # ratio 8 kept
])
def test_a_large_grouped_query_ratio_is_capped_at_8_query_heads(heads, kv, layouts, want):
    m = _plan("tiny", [f"--model.num_heads={heads}", f"--model.num_kv_heads={kv}", "--model.dim=1024"],
              layouts).cfg.model
    assert (m.num_heads, m.num_kv_heads) == want and m.dim // m.num_heads >= 8


def test_a_ratio_that_does_not_divide_dim_gets_an_explicit_head_dim():
    m = _plan("tiny", ["--model.num_heads=12", "--model.num_kv_heads=4", "--model.dim=192"], "ep=2").cfg.model
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (3, 1, 16)


def test_a_layout_the_trainer_would_refuse_is_refused_before_any_run():
    with pytest.raises(ValueError, match=r"layout tp=3: data.seq_len \(32\) must be a multiple of parallel.tp"):
        _plan("tiny", [], "tp=3")


def test_interleaved_virtual_stages_get_a_block_each():
    plan = _plan("hybrid-dp-ep-pp", ["--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"],
                 "pp=2,ep=2")
    assert plan.cfg.model.num_layers % (2 * 2) == 0


@pytest.mark.parametrize(("dense", "want_moe", "want_dense"), [
    ("[0,1]", [1, 2], [0]),      # two leading dense blocks: one kept, then the two MoE blocks
    ("[1]", [0, 2], [1]),
    ("[3]", [0, 1], [2]),        # a dense block after the MoE blocks is still verified
])
def test_the_shrunk_model_keeps_two_moe_blocks_and_a_dense_one(dense, want_moe, want_dense):
    plan = _plan("tiny", [f"--model.dense_layers={dense}"], "dp=2,ep=2")
    m = plan.cfg.model
    assert m.moe_layer_ids == want_moe
    assert [i for i in range(m.num_layers) if not m.is_moe_layer(i)] == want_dense
    assert any(c.field == "model.num_layers" for c in plan.changes)


def test_a_moe_every_pattern_is_kept_where_it_describes_the_blocks():
    m = _plan("tiny", ["--model.moe_every=2", "--model.moe_layer_offset=1"], "ep=2").cfg.model
    assert (m.num_layers, m.moe_every, m.moe_layer_offset, m.dense_layers) == (4, 2, 1, ())
