"""The planner: parameter lists, the ZeRO stage table, communication formulas worked by hand,
invalid choices, ranking, and ``moetrain plan --json`` for every preset config."""

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moetrain.cli.plan import add_parsers as add_plan_parser
from moetrain.cli.plan import parse_bytes, run_plan
from moetrain.config.job import JobConfig
from moetrain.config.loader import load_config
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.presets import get_preset
from moetrain.models.transformer import Transformer, count_params
from moetrain.plan import Layout, comm_per_step, make_plan, param_specs, rank_state_bytes
from moetrain.plan.plan_table import format_plan
from moetrain.plan.planner import Choice

CONFIGS = Path(__file__).resolve().parents[2] / "moetrain" / "configs"


def _tiny(vocab=4096):
    p = get_preset("tiny")
    return replace(p.model, vocab_size=vocab, preset=None), p.moe


def test_param_specs_are_the_instantiated_model():
    model_cfg, moe = _tiny(vocab=300)
    real = Transformer(model_cfg, moe=moe, seed=0)
    specs = param_specs(model_cfg, moe)
    assert [(s.name, s.shape) for s in specs] == [(n, tuple(p.shape)) for n, p in real.named_parameters()]
    assert sum(s.numel for s in specs if s.expert) == real.param_counts().expert


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "deepseek-moe-16b"])
def test_param_specs_of_large_presets_match_the_analytic_count(preset):
    # Built on the meta device: no memory, and the same list the model code would create.
    p = get_preset(preset)
    specs = param_specs(p.model, p.moe)
    counts = count_params(p.model, p.moe)
    assert sum(s.numel for s in specs) == counts.total
    assert sum(s.numel for s in specs if s.expert) == counts.expert


def test_sixteen_bytes_per_parameter_replicated():
    # fp32 param + fp32 grad + AdamW m and v: 4 + 4 + 8 = 16 bytes (the ZeRO paper's 2 + 2 + 12 in
    # mixed precision), plus a 4-byte step counter per tensor.
    specs = param_specs(*_tiny())
    n, tensors = sum(s.numel for s in specs), len(specs)
    b = rank_state_bytes(specs, Layout(world=1, ep=1, zero_stage=0), 0)
    assert (b.param, b.grad, b.optim) == (4 * n, 4 * n, 8 * n + 4 * tensors)


def test_zero_stage_table():
    """What each stage shards, on 8 ranks (ep = 1): stage 1 the optimizer states, stage 2 also
    the gradients, stage 3 (and 2, which FSDP keeps sharded at rest) also the parameters."""
    specs = param_specs(*_tiny())
    n = sum(s.numel for s in specs)
    W = 8
    s0, s1, s2, s3 = (rank_state_bytes(specs, Layout(world=W, ep=1, zero_stage=z), 0) for z in range(4))
    assert s0.param == s1.param == 4 * n and s0.grad == s1.grad == 4 * n
    assert s1.optim == pytest.approx(s0.optim / W, rel=0.01)
    for s in (s2, s3):
        assert s.param == pytest.approx(4 * n / W, rel=0.02) and s.grad == pytest.approx(4 * n / W, rel=0.02)
        assert s.optim == pytest.approx(s0.optim / W, rel=0.02)
    # Expert parallelism divides the experts before ZeRO divides what is left.
    e = sum(s.numel for s in specs if s.expert)
    s0_ep = rank_state_bytes(specs, Layout(world=W, ep=4, zero_stage=0), 0)
    assert s0_ep.param == 4 * (n - e + e // 4)


def test_empty_and_padded_shards_by_hand():
    # A 6-row router over 4 ranks: torch.chunk gives rows 2, 2, 2, 0; FSDP allocates 2 padded rows
    # everywhere; AdamW states follow the real rows; the step counter exists even when empty.
    model_cfg = ModelConfig(vocab_size=64, dim=8, num_layers=1, num_heads=2, moe_every=1, tie_embeddings=True)
    moe = MoEConfig(num_experts=6, top_k=2, expert_hidden_dim=8)
    router = [s for s in param_specs(model_cfg, moe) if s.name.endswith("router.gate.weight")]
    layout = Layout(world=4, ep=1, zero_stage=3)
    per_rank = [rank_state_bytes(router, layout, r) for r in range(4)]
    assert [b.param for b in per_rank] == [2 * 8 * 4] * 4
    assert [b.optim for b in per_rank] == [2 * 8 * 8 + 4] * 3 + [4]
    # Stage 1 slices the flattened 48 elements: 12 each.
    stage1 = Layout(world=4, ep=1, zero_stage=1)
    assert [rank_state_bytes(router, stage1, r).optim for r in range(4)] == [12 * 8 + 4] * 4


def test_comm_formulas_by_hand():
    model_cfg, moe = _tiny()
    specs = param_specs(model_cfg, moe)
    n = sum(s.numel for s in specs)
    e = sum(s.numel for s in specs if s.expert)
    W, T, accum = 4, 2048, 2

    def vol(stage, ep, **kw):
        return comm_per_step(specs, Layout(world=W, ep=ep, zero_stage=stage), model_cfg, moe,
                             tokens_per_micro_batch=T, grad_accum=accum, compute_bytes=4, **kw)

    # Stage 0: a ring all-reduce of the fp32 gradients, once per step whatever the accumulation.
    assert vol(0, 1).all_reduce == int(2 * 4 * n * (W - 1) / W)
    assert vol(0, 1).all_to_all == 0
    # Stage 1 adds an all-gather of the updated parameters.
    assert vol(1, 1).all_gather == int(4 * n * (W - 1) / W)
    # Experts at ep=2: dense gradients over all 4 ranks, the local expert half over edp = 2.
    assert vol(0, 2).all_reduce == int(2 * 4 * (n - e) * 3 / 4) + int(2 * 4 * (e // 2) * 1 / 2)
    # The textbook all-to-all volume per layer and pass: dispatch + combine of T*K copies of D
    # values, (ep-1)/ep of them leave the rank; forward + backward, 4 MoE layers, 2 micro-batches.
    per_layer = 2 * T * moe.top_k * model_cfg.dim * 4 * (2 - 1) / 2
    assert vol(0, 2).all_to_all == int(per_layer * 2 * 4 * accum)
    # Checkpointing the 4 MoE layers repeats their forward exchanges.
    assert vol(0, 2, ac_moe_layers_recomputed=4).all_to_all == int(per_layer * 3 * 4 * accum)
    # Stages 2/3: reduce-scatter once; all-gather per micro-step, twice for blocks at stage 3.
    s2, s3 = vol(2, 1), vol(3, 1)
    assert s2.reduce_scatter == s3.reduce_scatter == pytest.approx(4 * n * 3 / 4, rel=0.01)
    root = sum(s.numel for s in specs if not s.name.startswith("layers."))
    assert s2.all_gather == pytest.approx(4 * n * 3 / 4 * accum, rel=0.01)
    assert s3.all_gather == pytest.approx(4 * (2 * (n - root) + root) * 3 / 4 * accum, rel=0.01)


def test_comm_all_to_all_accounts_for_dispatch_dtype():
    """moe.dispatch_dtype by hand: per remote copy and MoE layer, the forward moves the dispatch row
    and the combine row, the backward two bf16 rows, a recompute the forward again."""
    model_cfg, moe = _tiny()
    specs = param_specs(model_cfg, moe)
    D, T, accum, num_moe = model_cfg.dim, 2048, 2, len(model_cfg.moe_layer_ids)
    remote = T * moe.top_k / 2  # copies a rank sends to the other at ep = 2, per layer and pass

    def a2a(dispatch_dtype, **kw):
        return comm_per_step(specs, Layout(world=4, ep=2, zero_stage=0), model_cfg,
                             replace(moe, dispatch_dtype=dispatch_dtype), tokens_per_micro_batch=T,
                             grad_accum=accum, compute_bytes=4, **kw).all_to_all

    fp32 = a2a("none")
    assert fp32 == int(remote * 2 * (4 * D) * 2 * num_moe * accum)
    assert a2a("bf16") == fp32 // 2
    fp8_forward = (D + 4) + 2 * D  # e4m3 row + its fp32 scale (D = 128: one block), bf16 combine
    assert a2a("fp8_e4m3") == int(remote * (fp8_forward + 2 * 2 * D) * num_moe * accum)
    assert a2a("fp8_e4m3", ac_moe_layers_recomputed=num_moe) == int(
        remote * (2 * fp8_forward + 2 * 2 * D) * num_moe * accum)
    assert a2a("fp8_e4m3") / fp32 == pytest.approx((7 * D + 4) / (16 * D))


def test_comm_dedup_sends_a_row_per_token_and_rank_and_the_copies_metadata():
    """moe.dispatch_dedup by hand (E = 8, K = 2, ep = 2): a token's row goes once to each rank its
    copies' experts live on, expected_groups_hit(8, 2, 2) = 2 * (1 - C(4, 2) / C(8, 2)) = 11/7
    ranks under uniform routing, half of them the other one; each remote copy adds its fp32 gate
    weight (forward, its gradient backward) and its row's index (int64; int32 in a compressed
    dispatch_dtype), forward only."""
    model_cfg, moe = _tiny()
    specs = param_specs(model_cfg, moe)
    D, T, accum, num_moe = model_cfg.dim, 2048, 2, len(model_cfg.moe_layer_ids)
    remote_copies = T * moe.top_k / 2  # per layer and pass

    def a2a(dispatch_dtype="none", **kw):
        return comm_per_step(specs, Layout(world=4, ep=2, zero_stage=0), model_cfg,
                             replace(moe, dispatch_dtype=dispatch_dtype, dispatch_dedup=True),
                             tokens_per_micro_batch=T, grad_accum=accum, compute_bytes=4, **kw).all_to_all

    rows = T * 11 / 7 / 2
    assert a2a() == pytest.approx((rows * 2 * 4 * D * 2 + remote_copies * (4 + 8 + 4)) * num_moe * accum, abs=1)
    fp8_forward = (D + 4) + 2 * D
    assert a2a("fp8_e4m3") == pytest.approx(
        (rows * (fp8_forward + 2 * 2 * D) + remote_copies * (4 + 4 + 4)) * num_moe * accum, abs=1)
    # A routing known exactly: one rank per token (round-robin routing at E = 4, K = 2, ep = 2).
    assert a2a(dedup_ranks_per_token=1.0) == pytest.approx(
        (T / 2 * 2 * 4 * D * 2 + remote_copies * (4 + 8 + 4)) * num_moe * accum, abs=1)


def test_comm_expert_choice_routes_its_capacity():
    """Expert choice (moe.router expert_choice) routes E * capacity copies, the MoE layer's own
    ``capacity``: at capacity factor 2 twice the T * K of token choice, which min(1, f) caps."""
    from moetrain.models.moe.layer import MoELayer

    model_cfg, moe = _tiny()
    ec = replace(moe, router="expert_choice", capacity_factor=2.0)
    D, T, accum, num_moe = model_cfg.dim, 2000, 2, len(model_cfg.moe_layer_ids)
    copies = ec.num_experts * MoELayer(model_cfg.dim, ec).capacity(T)

    def a2a(m):
        return comm_per_step(param_specs(model_cfg, m), Layout(world=4, ep=2, zero_stage=0), model_cfg, m,
                             tokens_per_micro_batch=T, grad_accum=accum, compute_bytes=4).all_to_all

    # Half the copies leave the rank, D fp32 values a row, dispatch and combine, forward and backward.
    assert a2a(ec) == int(copies / 2 * 4 * D * 2 * 2 * num_moe * accum)
    assert copies == 2 * T * moe.top_k and a2a(ec) == 2 * a2a(moe)
    assert a2a(replace(moe, capacity_factor=2.0)) == a2a(moe)


def test_comm_counts_the_multi_token_depths_tokens():
    """Depth k of model.mtp_depth is an MoE block routing the S - k positions of each sequence with a
    token k places ahead: its all-to-all (fp32 and fp8) and etp bytes are those of a trunk MoE layer
    at micro * (S - k) tokens, never recomputed; a dense model's depths exchange nothing."""
    model_cfg, moe = _tiny()
    mtp = replace(model_cfg, mtp_depth=2)
    micro, S, accum = 4, 64, 2
    T, D, num_moe = micro * S, model_cfg.dim, len(model_cfg.moe_layer_ids)
    routed = num_moe * T + micro * (S - 1) + micro * (S - 2)  # tokens over the MoE layers of a forward

    def vol(model, dispatch_dtype="none", **kw):
        return comm_per_step(param_specs(model, moe), Layout(world=4, ep=2, zero_stage=0, **kw), model,
                             replace(moe, dispatch_dtype=dispatch_dtype), tokens_per_micro_batch=T, grad_accum=accum,
                             compute_bytes=4, seq_len=S, ac_moe_layers_recomputed=num_moe)

    # Half of each routed token's K copies leave the rank (ep = 2); dispatch and combine, forward and
    # backward, the trunk's forward again (recomputed); D fp32 values a row.
    assert vol(mtp).all_to_all == int((routed * 2 * 2 + T * num_moe * 2) * moe.top_k / 2 * D * 4 * accum)
    fp8_forward = (D + 4) + 2 * D
    assert vol(mtp, "fp8_e4m3").all_to_all == int(
        (routed * (fp8_forward + 2 * 2 * D) + T * num_moe * fp8_forward) * moe.top_k / 2 * accum)
    assert vol(mtp).all_to_all > vol(model_cfg).all_to_all
    dense = replace(model_cfg, moe_every=0, mtp_depth=2)
    assert not dense.is_moe and vol(dense).all_to_all == 0
    # etp = 2 (ep = 1): per routed token, the gather of its row, K ids and K gate weights and the
    # reduce-scatter of its output row, forward; the backward swaps them (the weights' gradients back).
    etp = vol(mtp, etp=2)
    gather_fwd, scatter_fwd = D * 4 + 2 * 8 + 2 * 4, D * 4
    forwards = routed + T * num_moe
    assert etp.all_gather == (forwards * gather_fwd + routed * D * 4) * accum
    assert etp.reduce_scatter == (forwards * scatter_fwd + routed * (D * 4 + 2 * 4)) * accum
    # "moe" checkpointing recomputes every MoE layer, the depths' at their tokens too.
    every = comm_per_step(param_specs(mtp, moe), Layout(world=4, ep=2, zero_stage=0), mtp, moe,
                          tokens_per_micro_batch=T, grad_accum=1, compute_bytes=4, seq_len=S,
                          ac_moe_layers_recomputed=num_moe + 2)
    assert every.all_to_all == int(routed * 2 * 3 * moe.top_k / 2 * D * 4)
    # Without seq_len every depth counts at the whole micro-batch.
    no_len = comm_per_step(param_specs(mtp, moe), Layout(world=4, ep=2, zero_stage=0), mtp, moe,
                           tokens_per_micro_batch=T, grad_accum=1, compute_bytes=4)
    assert no_len.all_to_all == int((num_moe + 2) * T * 2 * 2 * moe.top_k / 2 * D * 4)


def test_comm_all_reduce_accounts_for_grad_compression():
    """dp.grad_compression by hand at stage 0, W = 4, ep = 2 (experts over edp = 2): bf16 halves the
    ring all-reduce; a compressed 1-bit Adam step sends, per tensor, its W - 1 foreign chunks in the
    all-to-all and its own chunk to W - 1 ranks, each chunk ceil(N / 8W) bytes of signs + a 4-byte scale."""
    model_cfg, moe = _tiny()
    specs = param_specs(model_cfg, moe)

    def all_reduce(mode):
        return comm_per_step(specs, Layout(world=4, ep=2, zero_stage=0), model_cfg, moe, tokens_per_micro_batch=64,
                             grad_accum=1, compute_bytes=4, grad_compression=mode).all_reduce

    def onebit(numel, group):
        return 2 * (group - 1) * (math.ceil(numel / (8 * group)) + 4)

    fp32 = all_reduce("none")
    assert all_reduce("bf16") == fp32 // 2
    expected = sum(onebit(s.numel, 4) for s in specs if not s.expert) + \
        sum(onebit(s.numel // 2, 2) for s in specs if s.expert)
    assert all_reduce("onebit") == expected
    assert all_reduce("onebit") / fp32 < 1 / 30


def _job(*, moe_every: int = 1) -> JobConfig:
    from moetrain.config.data import DataConfig
    from moetrain.config.train import TrainConfig

    return JobConfig(model=ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=2, max_seq_len=64,
                                       moe_every=moe_every),
                     moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=64),
                     train=TrainConfig(global_batch_size=16, micro_batch_size=2),
                     data=DataConfig(seq_len=64, vocab_size=512))


def test_invalid_choices_say_why():
    plan = make_plan(_job(), nproc=8)
    reasons = {r.reason for r in plan.rows if not r.valid}
    assert "parallel.ep (8) must divide moe.num_experts (4)" in reasons
    assert "zero.offload_param ('cpu') needs parallel.zero_stage = 3 (is 2)" in reasons
    assert "zero.offload_optimizer ('cpu') needs parallel.zero_stage >= 1 (is 0)" in reasons
    text = format_plan(plan)
    assert "invalid:" in text and "must divide moe.num_experts" in text


def test_dense_model_and_one_rank():
    plan = make_plan(_job(moe_every=0), nproc=2)
    assert all(not r.valid for r in plan.rows if r.choice.ep > 1 or r.choice.ac == "moe")
    one = make_plan(_job(), nproc=1)
    assert all(not r.valid for r in one.rows if r.choice.zero_stage > 0)
    assert any(r.valid for r in one.rows)


def test_ranking_fits_and_fewest_bytes_first():
    plan = make_plan(_job(), nproc=4)
    devices = sorted(r.device_bytes for r in plan.rows if r.valid)
    limit = devices[len(devices) // 2]
    plan = make_plan(_job(), nproc=4, device_memory=limit)
    ranked = plan.ranked
    assert ranked and all(r.fits and r.device_bytes <= limit for r in ranked)
    # Stage 3 after every lighter choice that fits; fewest bytes first within each (one node).
    heavy = [r.choice.zero_stage == 3 for r in ranked]
    assert heavy == sorted(heavy) and any(heavy) and not all(heavy)
    for group in ([r for r in ranked if r.choice.zero_stage < 3], [r for r in ranked if r.choice.zero_stage == 3]):
        totals = [r.comm["total"] for r in group]
        assert totals == sorted(totals)
    assert any(r.valid and not r.fits for r in plan.rows)


def test_ep_across_nodes_ranks_last():
    plan = make_plan(_job(), nproc=4, nodes=2)
    ranked = plan.ranked
    for light in (True, False):  # within the stage < 3 choices, and within the stage-3 ones
        crossing = [i for i, r in enumerate(ranked) if r.choice.ep == 4 and (r.choice.zero_stage < 3) == light]
        inside = [i for i, r in enumerate(ranked) if r.choice.ep <= 2 and (r.choice.zero_stage < 3) == light]
        assert crossing and inside and max(inside) < min(crossing)
    assert all("spans nodes" in r.notes[0] for r in ranked if r.choice.ep == 4)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1234") == 1234
    with pytest.raises(ValueError, match="--device-memory"):
        parse_bytes("lots")


def test_batch_errors_name_the_fields():
    with pytest.raises(ValueError, match=r"train.global_batch_size \(16\) must be divisible by the data-parallel "
                                         r"size \(3\)"):
        make_plan(_job(), nproc=3)  # 16 sequences do not split over 3 ranks
    with pytest.raises(ValueError, match="--nodes"):
        make_plan(_job(), nproc=4, nodes=3)


@pytest.mark.parametrize("global_bs, micro, accum, dp, planned, named", [
    (16, 2, None, 4, (2, 2), None),                            # the config's own split
    (16, 8, None, 8, (2, 1), "train.micro_batch_size (8)"),    # 8 * 8 > 16: two per rank, one micro-batch
    (48, 8, None, 4, (6, 2), "train.micro_batch_size (8)"),    # 12 per rank: 8 does not divide it, 6 does
    (32, 4, 4, 4, (4, 2), "train.grad_accum (4)"),             # the explicit grad_accum does not hold on 4 ranks
])
def test_planned_micro_batch_by_hand(global_bs, micro, accum, dp, planned, named):
    from moetrain.config.train import TrainConfig
    from moetrain.plan.planner import planned_micro_batch

    got_micro, got_accum, note = planned_micro_batch(
        TrainConfig(global_batch_size=global_bs, micro_batch_size=micro, grad_accum=accum), dp)
    assert (got_micro, got_accum) == planned and got_micro * got_accum * dp == global_bs
    if named is None:
        assert note is None
    else:
        assert note.startswith(f"planned with micro-batch {got_micro} and {got_accum} accumulation step(s): "
                               f"{named}"), note
        assert f"the {global_bs // dp} sequences per rank (train.global_batch_size ({global_bs}) / {dp} ranks)" in note


def test_a_configured_tp_pp_or_etp_is_named_as_outside_the_main_table():
    plain = make_plan(load_config("tiny", []), nproc=4)
    assert plain.layout_note is None and "layout_note" in plain.to_dict()
    plan = make_plan(load_config("tiny", ["--parallel.tp=2", "--parallel.etp=2"]), nproc=4)
    assert plan.layout_note.startswith("this config sets parallel.tp (2), parallel.etp (2); the table plans every "
                                       "rank data-parallel")
    assert "note: " + plan.layout_note in format_plan(plan)
    assert plan.to_dict()["layout_note"] == plan.layout_note


def test_default_config_plans_on_eight_ranks_with_the_micro_batch_it_assumed(capsys):
    """16 sequences of 8 do not split over 8 ranks: the plan assumes 2 per rank and says so."""
    import argparse

    plan = make_plan(JobConfig(), nproc=8)
    assert (plan.micro_batch_size, plan.grad_accum, plan.tokens_per_micro_batch) == (2, 1, 2 * 256)
    assert plan.batch_note.startswith("planned with micro-batch 2 and 1 accumulation step(s)")
    assert any(r.valid for r in plan.rows)
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="cmd"))
    assert run_plan(parser.parse_args(["plan", "--nproc", "8"])) == 0
    text = capsys.readouterr().out
    assert "512 tokens per micro-batch (2 sequence(s))" in text and "note: planned with micro-batch 2" in text
    # The activation estimate follows the assumed micro-batch, not the configured 8.
    from moetrain.config.train import TrainConfig

    small = make_plan(JobConfig(train=TrainConfig(global_batch_size=16, micro_batch_size=2)), nproc=8)
    assert small.batch_note is None
    for a, b in zip(plan.rows, small.rows, strict=True):
        assert (a.choice, a.activation_bytes, a.comm) == (b.choice, b.activation_bytes, b.comm)


@pytest.mark.parametrize("config,nproc,nodes", [("tiny.yaml", 2, 1), ("tiny-dense.yaml", 2, 1),
                                                ("mixtral-8x7b.yaml", 64, 8), ("deepseek-moe-16b.yaml", 32, 4)])
def test_plan_cli_json_for_presets(config, nproc, nodes, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["plan", "--config", str(CONFIGS / config), "--nproc", str(nproc), "--nodes", str(nodes),
                              "--device-memory", "80GiB", "--json"])
    assert run_plan(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world"] == nproc and data["ranked"], config
    best = data["ranked"][0]
    for key in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "a2a_buffer_bytes", "device_bytes"):
        assert best[key] >= 0
    assert set(best["comm"]) >= {"all_to_all", "all_reduce", "reduce_scatter", "all_gather", "total"}
    assert len(best["per_rank_states"]) == nproc
    assert all(c["valid"] or c["reason"] for c in data["choices"])
    # Text mode prints the same plan.
    args.json = False
    assert run_plan(args) == 0
    assert "zero=" in capsys.readouterr().out


def test_mixtral_experts_shard_on_dim1_when_ep_leaves_one_per_rank():
    # 8 experts at ep = 8 leave one per rank; over edp = 8, dim-0 chunks would pad every rank to
    # a whole expert (no saving at all). Dim 1 is split instead: 1/8 of an expert each.
    p = get_preset("mixtral-8x7b")
    specs = [s for s in param_specs(p.model, p.moe) if s.expert][:3]
    one_expert = sum(math.prod(s.shape[1:]) for s in specs)
    b = rank_state_bytes(specs, Layout(world=64, ep=8, zero_stage=3), 5)
    assert b.param == 4 * one_expert // 8


def test_cli_config_overrides_apply():
    cfg = load_config(CONFIGS / "tiny.yaml", ["--train.micro_batch_size=4", "--data.seq_len=128"])
    plan = make_plan(cfg, nproc=2)
    assert plan.tokens_per_micro_batch == 512 and plan.grad_accum == 2
    assert torch.is_tensor(torch.zeros(1))  # the planner allocated nothing real on the way


def test_device_profile_adds_step_time_and_ranks_by_it(capsys):
    from moetrain.plan.step_time import H100_SXM, estimate_for_config

    cfg = load_config("mixtral-8x7b", [])
    plan = make_plan(cfg, nproc=64, nodes=8, device_memory=parse_bytes("80GiB"), profile=H100_SXM)
    ranked = plan.ranked
    timed = [r for r in ranked if r.step is not None]
    assert timed and all(r.choice.offload == "none" for r in timed)
    assert all(r.step is None for r in plan.rows if r.choice.offload != "none")
    # Stage 3 after every lighter choice; within each, fastest first and untimed after.
    heavy = [r.choice.zero_stage == 3 for r in ranked]
    assert heavy == sorted(heavy)
    for light in (True, False):
        group = [r for r in ranked if (r.choice.zero_stage < 3) == light]
        timed_group = [r for r in group if r.step is not None]
        times = [r.step["step_s"] for r in timed_group]
        assert timed_group and times == sorted(times) and group[:len(timed_group)] == timed_group
    # The row of the config's own layout (ep 8, ZeRO-3, full checkpointing) is estimate_for_config's.
    own = next(r for r in plan.rows if r.choice == Choice(zero_stage=3, ep=8, offload="none", ac="full"))
    assert own.step["step_s"] == pytest.approx(estimate_for_config(cfg, world=64, nodes=8, profile=H100_SXM).step_s)
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["plan", "--config", "mixtral-8x7b", "--nproc", "64", "--nodes", "8",
                              "--device-profile", "h100"])
    assert run_plan(args) == 0
    assert "step s" in capsys.readouterr().out
