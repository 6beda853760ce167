"""The planner under routing skew (``moetrain.plan.skew``): shares, replica placement and per-rank
copies worked by hand, a spec's shares against the closed form of sampling without replacement,
the rows' consistency with the balanced plan, and ``moetrain plan --skew --dry-run`` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.config.loader import load_config
from moetrain.plan.model_states import param_specs
from moetrain.plan.skew import copies_bound, make_skew_plan, place_replicas, rank_copies, spec_shares
from moetrain.plan.step_time import H100_SXM

# 2 MoE blocks of 8 experts top-2 at ep = 4: 4 sequences of 64 tokens per rank (N = 512 copies).
TINY = ["--model.dim=64", "--model.num_layers=2", "--model.num_heads=4", "--model.max_seq_len=64",
        "--moe.num_experts=8", "--moe.top_k=2", "--moe.expert_hidden_dim=128", "--data.tokenizer=bytes",
        "--data.seq_len=64", "--train.global_batch_size=16", "--train.micro_batch_size=4", "--parallel.ep=4"]


def test_hot_expert_share_is_its_inclusion_probability_over_top_k():
    """hot:1:0.5 over 4 experts, top-2 without replacement: expert 0 is drawn first with p = 0.5, second
    with sum_j w_j * w_0 / (1 - w_j) = 3 * 1/6 * 0.5 / (5/6) = 0.3; its share of the copies (0.5 + 0.3) / 2."""
    (share_E,) = spec_shares("hot:1:0.5", num_experts=4, top_k=2)
    assert share_E[0].item() == pytest.approx(0.4, abs=0.005)
    assert share_E[1:].tolist() == pytest.approx([0.2] * 3, abs=0.005)
    drift = spec_shares("drift:1.2:3", num_experts=4, top_k=2)
    assert len(drift) == 4 and torch.equal(drift[1], torch.roll(drift[0], 1))


def test_rank_copies_worked_by_hand():
    share_E = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    held = [[0, 1], [2, 3]]  # the ep sharding's own order
    got = rank_copies(share_E, copies=800, ep=2, edp=1, capacity=None, held=held)
    assert got.expected == [600, 200] and got.kept_fraction == 1
    got = rank_copies(share_E, copies=800, ep=2, edp=1, capacity=250, held=held)  # expert 0 keeps 250 of 400
    assert got.expected == [450, 200] and got.cap == [500, 500] and got.kept_fraction == 650 / 800
    # Two ep groups (edp = 2) each get half; expert 0 in two slots splits its copies.
    got = rank_copies(share_E, copies=800, ep=2, edp=2, capacity=None, held=[[0, 1, 2], [0, 3, 2]])
    assert got.expected == [(200 + 200 + 50) / 2, (200 + 100 + 50) / 2]
    assert copies_bound(100.0, None) == 130 and copies_bound(100.0, 120.0) == 120


def test_replicas_of_the_hottest_then_longest_processing_time_first():
    # loads 8, 4, 2, 2 on 2 ranks of 3 slots: expert 0 gets a second replica (4 each), then expert 1
    # (2 each); packed largest first onto the least-loaded rank: 4 | 4, 2 | 2, then 2 | 2.
    assert place_replicas([8.0, 4.0, 2.0, 2.0], ep=2, slots_per_rank=3) == [[0, 1, 2], [0, 1, 3]]
    assert place_replicas([8.0, 4.0, 2.0, 2.0], ep=2, slots_per_rank=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="slots per rank"):
        place_replicas([1.0] * 4, ep=2, slots_per_rank=1)


def test_rows_agree_with_the_balanced_plan_and_each_other():
    cfg = load_config(None, TINY)
    plan = make_skew_plan(cfg, nproc=4, skew="zipf:1.2", device_memory=int(plan_memory(cfg)), profile=H100_SXM)
    rows = {r.setting: r for r in plan.rows}
    dropless, cap1 = rows["dropless"], rows["capacity 1.0"]
    assert dropless.mean_copies == 512 and sum(dropless.copies_per_rank) == pytest.approx(4 * 512)
    assert dropless.max_over_mean > 2 and dropless.dropped_fraction == 0
    per_rank = dropless.activation_bytes_per_rank  # rank 0 holds the hottest experts 0 and 1
    assert len(per_rank) == 4 and per_rank[0] == dropless.activation_bytes > per_rank[1] > per_rank[3]
    # Capacity 1.0 caps the hot rank's two experts at T*K/E each: exactly the balanced N, so the
    # hottest rank's memory is the balanced plan's.
    assert cap1.bound_copies == 512 and cap1.device_bytes == plan.balanced_device_bytes
    assert cap1.dropped_fraction > 0.2 and cap1.step_ratio_vs_balanced == pytest.approx(1.0)
    slots = rows["dropless, 1 spare slot(s)"]
    assert slots.max_over_mean < 1.1 and slots.slot_state_bytes > 0 and len(slots.placement[0]) == 3
    assert dropless.step_ratio_vs_balanced > slots.step_ratio_vs_balanced > 1
    assert dropless.device_bytes > slots.device_bytes and dropless.fits is False and slots.fits is True
    assert plan.recommendation.startswith("parallel.expert_slots_per_rank = num_experts / ep + 1")


def test_a_rank_computing_alone_gets_the_cores_its_waiting_peers_leave():
    from dataclasses import replace

    from moetrain.plan.planner import resolve_vocab
    from moetrain.plan.skew import _step_parts

    cfg = load_config(None, TINY)
    shared = replace(H100_SXM, core_share=0.5)  # 4 single-thread ranks on 2 cores
    plan = make_skew_plan(cfg, nproc=4, skew="zipf:1.2", profile=H100_SXM)
    own, half = plan.rows[0], make_skew_plan(cfg, nproc=4, skew="zipf:1.2", profile=shared).rows[0]
    model = resolve_vocab(cfg)
    parts = _step_parts(cfg, model, param_specs(model, cfg.moe), nproc=4, micro=plan.micro_batch_size,
                        accum=plan.grad_accum, per_node=4, profile=H100_SXM)
    f = own.max_over_mean
    assert f > 2 and half.step_s < own.step_s
    assert own.step_s - half.step_s == pytest.approx((f - 1) * parts["skewable_compute_s"] * 0.5, rel=1e-9)
    assert half.step_s > own.step_s - (f - 1) * parts["skewable_compute_s"]  # the all-to-all still waits


def plan_memory(cfg) -> float:
    """A device between the one-spare-slot row and the dropless row of zipf:1.2."""
    rows = {r.setting: r for r in make_skew_plan(cfg, nproc=4, skew="zipf:1.2").rows}
    return (rows["dropless"].device_bytes + rows["dropless, 1 spare slot(s)"].device_bytes) / 2


def test_cli_plans_the_skew_and_confirms_its_buffers(capsys):
    from moetrain.cli import main

    assert main(["plan", "--nproc", "4", *TINY, "--skew", "hot:1:0.5", "--capacity-factors", "1.25",
                 "--spare-slots", "1", "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["setting"] for r in out["rows"]] == ["dropless", "capacity 1.25", "dropless, 1 spare slot(s)"]
    checks = out["buffer_checks"]
    assert len(checks) == 3 and all(c["confirmed"] and 0 < c["drawn_copies"] <= c["planned_copies"] for c in checks)
    assert main(["plan", "--nproc", "4", *TINY, "--skew", "zipf:1", "--spare-slots", "x"]) == 2
    assert "--spare-slots ('x') must be a comma-separated list" in capsys.readouterr().err


def test_a_counts_trace_is_planned_from_its_recorded_loads(tmp_path, capsys):
    """A counts trace of one step and one layer over 4 experts at ep = 2 (hand-written): global counts
    [6, 2, 0, 0] -> shares [0.75, 0.25, 0, 0]; the planned 2-rank layout puts experts 0-1 (all the
    copies) on rank 0: twice the mean, and the dry run reads the same counts back."""
    from moetrain.train.routing_trace import INDEX, TRACE_DIR, step_file
    from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

    folder = tmp_path / TRACE_DIR
    folder.mkdir()
    for rank, counts in enumerate(([5, 1, 0, 0], [1, 1, 0, 0])):
        with ShardedWriter(folder, [TensorSpec("counts.L", (4,), torch.int32)], metadata={},
                           weights=step_file(1, rank)) as w:
            w.write("counts.L", torch.tensor(counts, dtype=torch.int32))
            w.close()
    (folder / INDEX).write_text(json.dumps({"format": 1, "mode": "counts", "layers": ["L"], "num_experts": 4,
                                            "top_k": 2, "tokens_per_step": 4, "world_size": 2, "ep": 2, "steps": [1]}))
    overrides = [*TINY, "--moe.num_experts=4", "--parallel.ep=2"]
    plan = make_skew_plan(load_config(None, overrides), nproc=2, routing_trace=str(tmp_path),
                          capacity_factors=(1.0,), spare_slots=(1,))
    dropless, cap1, slot = plan.rows
    # 4 sequences x 64 tokens x top-2 per rank and micro-batch: N = 512, G = 1024 copies over the 2 ranks.
    assert dropless.copies_per_rank == [1024, 0] and dropless.max_over_mean == 2
    # Capacity 1.0: 256 copies per expert; expert 0 keeps 256 of its 768, expert 1 all 256.
    assert cap1.copies_per_rank == [512, 0] and cap1.dropped_fraction == 0.5 and cap1.bound_copies == 512
    # One spare slot per rank: replicas of experts 0 (0.375 + 0.375) and 1 (0.125 + 0.125), one of each per rank.
    assert slot.placement == [[0, 1, 2], [0, 1, 3]] and slot.copies_per_rank == [512, 512]
    from moetrain.cli import main

    assert main(["plan", "--nproc", "2", *overrides, "--routing-trace", str(tmp_path), "--dry-run", "--json",
                 "--capacity-factors", "1.0", "--spare-slots", "1"]) == 0
    checks = json.loads(capsys.readouterr().out)["buffer_checks"]
    # The recorded counts scaled to one micro-batch (1024 copies): 768 and 256; planned = mean + 3 sigma, capped.
    assert [(c["drawn_copies"], c["planned_copies"]) for c in checks] == [(1024, 1120), (512, 512), (512, 580)]
    # The same trace as --skew trace:PATH: its errors name --skew, the flag that gave it.
    with pytest.raises(ValueError, match=r"^--skew \('trace:.*'\): the trace's experts \(4\) do not match "
                                         r"moe.num_experts \(8\)"):
        make_skew_plan(load_config(None, [*TINY, "--parallel.ep=2"]), nproc=2, skew=f"trace:{tmp_path}")
    # Rank 1's file gone (a rank that died): no step is complete, and the error says so.
    (folder / step_file(1, 1)).unlink()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"^--routing-trace .*holds no complete step"):
        make_skew_plan(load_config(None, overrides), nproc=2, routing_trace=str(tmp_path))
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"^--skew \('trace:.*holds no complete step"):
        make_skew_plan(load_config(None, overrides), nproc=2, skew=f"trace:{tmp_path}")


def test_spare_slots_beyond_the_trainers_slot_rule_are_refused(capsys):
    """tiny has 8 experts: at ep = 2 a rank holds 4 home experts, so at most 4 spare slots (8 per rank, the
    trainer's bound on parallel.expert_slots_per_rank); 5 would recommend a setting the trainer refuses."""
    from moetrain.cli import main

    cfg = load_config("tiny", ["--parallel.ep=2"])
    assert cfg.moe.num_experts == 8
    with pytest.raises(ValueError, match=r"--spare-slots \(5\) must be <= .*\(4\).*moe.num_experts \(8\)"):
        make_skew_plan(cfg, nproc=2, skew="hot:1:0.9", spare_slots=(5,))
    rows = make_skew_plan(cfg, nproc=2, skew="hot:1:0.9", capacity_factors=(), spare_slots=(4,)).rows
    assert [r.spare_slots for r in rows] == [0, 4] and all(len(p) <= 8 for p in rows[1].placement)
    # The default 1,2 keeps those that fit: none at ep = 1 (the trainer needs ep > 1 for spare slots).
    one = make_skew_plan(load_config("tiny", ["--parallel.ep=1"]), nproc=2, skew="hot:1:0.9", capacity_factors=())
    assert [r.spare_slots for r in one.rows] == [0]
    assert main(["plan", "--config", "tiny", "--nproc", "2", "--parallel.ep=2", "--skew", "hot:1:0.9",
                 "--spare-slots", "5", "--device-memory", "265MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--spare-slots (5)" in err


@pytest.mark.parametrize("override, field", [("--dp.grad_compression=onebit", "dp.grad_compression"),
                                              ("--parallel.zero_stage=2", "parallel.zero_stage")])
def test_no_spare_slots_for_a_job_the_trainer_will_not_rebalance(override, field):
    """Expert rebalancing is refused with 1-bit Adam and with ZeRO-2/3 (config.parallel.check_rebalancing):
    the plan drops its default spare-slot rows there, and names the rule for an explicit --spare-slots."""
    cfg = load_config("tiny", ["--parallel.ep=2", override])
    rows = make_skew_plan(cfg, nproc=2, skew="hot:1:0.9", capacity_factors=()).rows
    assert [r.spare_slots for r in rows] == [0]
    with pytest.raises(ValueError, match=rf"--spare-slots \(1\) this job cannot rebalance experts: {field}"):
        make_skew_plan(cfg, nproc=2, skew="hot:1:0.9", spare_slots=(1,))
