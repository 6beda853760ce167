"""``moetrain plan`` lists pipeline-parallel choices with their bubble fraction, the largest rank's
parameters and activations, and advises a pipeline when nothing else fits."""

from __future__ import annotations

from moetrain.config.loader import load_config
from moetrain.plan.plan_table import format_plan
from moetrain.plan.planner import make_plan

OVERRIDES = ["model.dim=64", "model.num_layers=4", "model.num_heads=4", "moe.num_experts=4", "moe.expert_hidden_dim=64",
             "data.seq_len=32", "model.max_seq_len=32", "train.global_batch_size=16",
             "train.micro_batch_size=2"]


def test_plan_lists_pipeline_choices_with_bubble_fractions():
    cfg = load_config(None, OVERRIDES)
    plan = make_plan(cfg, nproc=4, stages=(0,), offloads=("none",), acs=("none",))
    rows = {(c.pp, c.schedule): c for c in plan.pp_rows}
    # pp 2 (dp 2): 16 / (2 * 2) = 4 micro-batches; pp 4 (dp 1): 8. Interleaved needs 2 blocks per
    # rank, so not at pp 4 with 4 blocks.
    assert sorted(rows) == [(2, "1f1b"), (2, "gpipe"), (2, "interleaved_1f1b"), (4, "1f1b"), (4, "gpipe")]
    assert rows[(2, "gpipe")].num_microbatches == 4 and rows[(4, "1f1b")].num_microbatches == 8
    assert rows[(2, "1f1b")].bubble_fraction == 1 / 5  # (p - 1) / (m + p - 1)
    assert rows[(2, "interleaved_1f1b")].bubble_fraction == 1 / 9  # (p - 1) / (v m + p - 1), v = 2
    assert rows[(4, "gpipe")].bubble_fraction == 3 / 11
    # 1F1B holds at most pp micro-batches of activations, GPipe all of them.
    assert rows[(2, "1f1b")].activation_bytes < rows[(2, "gpipe")].activation_bytes
    # Half the blocks on each of 2 ranks: fewer parameters per rank than on 1, more than on 4.
    assert rows[(4, "gpipe")].max_params < rows[(2, "gpipe")].max_params < plan.counts["total"]
    assert rows[(2, "gpipe")].state_bytes == rows[(2, "gpipe")].max_params * 16
    text = format_plan(plan)
    assert "pipeline choices" in text and "interleaved_1f1b" in text
    assert plan.to_dict()["pipeline_parallel"][0]["pp"] == 2


def test_plan_advises_a_pipeline_when_nothing_else_fits():
    cfg = load_config(None, OVERRIDES)
    roomy = make_plan(cfg, nproc=4, stages=(0,), offloads=("none",), acs=("none",), device_memory=2**40)
    assert not any("no layout without pipelining fits" in line for line in format_plan(roomy).splitlines())
    # Between the whole model's states and a 4-stage share of them.
    four = {c.schedule: c for c in roomy.pp_rows if c.pp == 4}["1f1b"]
    budget = four.state_bytes + four.activation_bytes + 1
    tight = make_plan(cfg, nproc=4, stages=(0,), eps=(1,), offloads=("none",), acs=("none",), device_memory=budget)
    assert not any(r.fits for r in tight.rows if r.valid)
    advice = [line for line in format_plan(tight).splitlines() if line.startswith("advice: no layout without")]
    assert len(advice) == 1 and "parallel.pp=" in advice[0]
