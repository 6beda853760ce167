"""``moetrain verify``'s pieces that need no training run: layouts, the shrink, the comparison and
its report. The runs themselves are tested in tests/integration/test_verify_mutations.py."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch

from moetrain.config.loader import load_config
from moetrain.plan.planner import make_plan
from moetrain.verify.checks import EXACT, Comparison, Precision, Tolerance, counts_from_shares
from moetrain.verify.layouts import Layout, auto_layouts, fold, micro_batch_sizes, parse_layouts
from moetrain.verify.report import last_line, table, write_json
from moetrain.verify.shrink import shrink_job


def test_layouts_parse_into_degrees_and_processes():
    a, b, c = parse_layouts("ep=2,dp=2; pp=2,ep=2; zero=3,ep=2")
    assert (a.world, a.dp, a.ep) == (2, 2, 2)
    assert (b.world, b.dp, b.pp) == (4, 2, 2)
    assert (c.world, c.zero, c.name) == (2, 3, "dp=2,ep=2,zero=3")
    assert parse_layouts("ep=2; ep=2 ,dp=2") == [Layout(dp=2, ep=2)]
    assert "--parallel.zero_stage=3" in c.overrides(micro_batch=2)


@pytest.mark.parametrize("text, message", [
    ("ep", "must be KEY=N"), ("sp=2", "must be KEY=N"), ("zero=4", "zero one of"), (" ; ", "names no layout"),
])
def test_bad_layouts_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        parse_layouts(text)


def test_every_layout_runs_the_micro_batches_one_process_runs():
    lays = [Layout(), Layout(dp=2, ep=2), Layout(dp=4, ep=2)]
    assert list(micro_batch_sizes(lays, global_batch=8, grad_accum=2).values()) == [4, 2, 1]
    with pytest.raises(ValueError, match="train.global_batch_size"):
        micro_batch_sizes([Layout(dp=3)], global_batch=8, grad_accum=2)


def test_auto_takes_the_layouts_the_planner_ranks_best_folded():
    cfg = load_config("mixtral-8x7b")
    ranked = make_plan(replace(cfg, parallel=replace(cfg.parallel, dp=-1)), nproc=64).ranked
    lays = auto_layouts(cfg, nproc=64)
    distinct: list[tuple[int, int]] = []  # the ranked (ep, stage) choices as they fold, first two distinct
    for r in ranked:
        if (key := (min(r.choice.ep, 2), r.choice.zero_stage)) not in distinct:
            distinct.append(key)
    assert [(lay.ep, lay.zero) for lay in lays] == distinct[:2]
    assert lays == [Layout(dp=2, ep=2), Layout(dp=2, ep=2, zero=1)]
    # The job's pp is kept; at 4 processes the planner prefers ep = 1 second: still one layout has ep > 1.
    assert auto_layouts(load_config("hybrid-dp-ep-pp")) == [Layout(dp=2, ep=2, pp=2), Layout(dp=2, pp=2)]
    tiny = auto_layouts(load_config("tiny"))
    assert any(lay.ep > 1 for lay in tiny) and all(1 < lay.world <= 4 for lay in tiny) and len(tiny) == 2
    dense = auto_layouts(load_config("tiny-dense"))  # a 1-process job is planned at 2
    assert [lay.dp for lay in dense] == [2, 2] and all(lay.ep == 1 for lay in dense)


def test_fold_caps_each_degree_and_the_processes():
    assert fold(Layout(dp=64, ep=64, tp=8, pp=4, zero=1)) == Layout(dp=2, ep=2, pp=2, zero=1)
    assert fold(Layout(dp=8, ep=8, tp=2, etp=2)) == Layout(dp=2, ep=2, tp=2, etp=2)
    assert fold(Layout(dp=16)) == Layout(dp=2)


def test_shrink_keeps_the_math_and_says_what_changed():
    cfg = load_config("deepseek-v3")
    small, changes = shrink_job(cfg, pps=[2], cpu=True)
    for section, name in [("moe", "num_experts"), ("moe", "top_k"), ("moe", "router"), ("moe", "num_expert_groups"),
                          ("moe", "top_groups"), ("moe", "router_bias_update_rate"), ("moe", "aux_loss_type"),
                          ("moe", "num_shared_experts"), ("moe", "capacity_factor"), ("train", "dtype"),
                          ("parallel", "zero_stage")]:
        assert getattr(getattr(small, section), name) == getattr(getattr(cfg, section), name), name
    assert small.model.num_layers % 2 == 0 and small.model.moe_layer_offset == 1  # a dense block kept
    assert small.model.dim == 64 and small.data.tokenizer == "bytes" and small.train.device == "cpu"
    changed = {c.field: c for c in changes}
    assert changed["model.num_layers"].old == 61 and "moe.num_experts" not in changed
    assert "random per rank" not in " ".join(c.why for c in changes)  # V3 draws no per-rank noise
    # A job set up for NCCL is verified on gloo here, as docs/verify.md says (the config refuses nccl on a CPU).
    nccl = load_config("deepseek-v3", ["--parallel.backend=nccl", "--train.device=cuda"])
    small, changes = shrink_job(nccl, pps=[2], cpu=True)
    assert small.parallel.backend == "auto" and {c.field for c in changes} >= {"parallel.backend", "train.device"}


def test_shrink_names_and_zeroes_per_rank_randomness():
    cfg = load_config("tiny", ["--moe.router_noise_std=0.1", "--model.dropout=0.1"])
    small, changes = shrink_job(cfg, pps=[1], cpu=True)
    assert small.moe.router_noise_std == 0 and small.model.dropout == 0
    whys = {c.field: c.why for c in changes}
    assert "random per rank" in whys["moe.router_noise_std"] and "random per rank" in whys["model.dropout"]


def test_comparison_bounds_and_first_failure_by_step():
    out = Comparison()
    out.values("loss", [1.0, 2.0], [1.0, 2.0 + 1e-6], Tolerance(0.0, 1e-6, "x"), step=1)  # inside: 5e-7 rel
    out.values("counts", [3, 5], [3, 5], EXACT, step=1)
    out.values("counts", [4, 4], [3, 5], EXACT, step=2)  # a token changed expert at step 2
    out.values("grad_norm", 1.5, 1.0, Tolerance(0.0, 1e-3, "x"), step=1)
    out.missing("bias", "absent", step=3)
    rows = {r.quantity: r for r in out.results}
    assert rows["loss"].ok and not rows["counts"].ok and rows["counts"].max_abs == 1.0
    assert out.first_failure is rows["grad_norm"]  # step 1 before step 2
    assert last_line(out).startswith("verify: FAIL: grad_norm") and "3 quantities failed" in last_line(out)
    assert "PASS" in table(out) and "FAIL" in table(out)


def test_scaled_comparison_is_relative_to_each_tensors_largest_entry():
    out = Comparison()
    big, small = torch.tensor([100.0, 0.0]), torch.tensor([1e-3, 1e-9])
    r = out.scaled("m", [(big + torch.tensor([0.0, 1e-3]), big), (small, small)], Tolerance(0.0, 1e-4, "x"))
    assert r.ok and math.isclose(r.max_rel, 1e-5, rel_tol=1e-4)
    r = out.scaled("m2", [(big * 2, big)], Tolerance(0.0, 1e-4, "x"))
    assert not r.ok


def test_precision_bounds_grow_with_the_rounding():
    fp32, bf16, fp8 = Precision("fp32"), Precision("bf16"), Precision("fp32", "fp8")
    assert fp32.scalar_rel() < 1e-4 < bf16.scalar_rel() <= fp8.scalar_rel()
    assert all(bf16.bound(kind) < fp8.bound(kind) for kind in ("aux", "moments", "routing"))
    assert not fp32.low_precision and bf16.low_precision and fp8.low_precision


def test_counts_come_back_exact_from_rounded_shares():
    counts = torch.tensor([[517.0, 3.0, 1000.0, 528.0]])
    shares = [[round(v, 5) for v in (counts / counts.sum()).tolist()[0]]]
    assert torch.equal(counts_from_shares(shares, [2048]), counts)


def test_json_report(tmp_path):
    out = Comparison()
    out.values("loss", 1.0, 1.0, EXACT, step=1)
    out.note("HF export", "no family")
    write_json(tmp_path / "v.json", out, changes=[], layouts=["dp=2,ep=2"], excluded={}, steps=3)
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["passed"] and [r["status"] for r in doc["results"]] == ["PASS", "SKIP"]


def test_the_command_refuses_a_bad_layout_before_running_anything(capsys, tmp_path):
    from moetrain.cli import main

    assert main(["verify", "--config", "tiny", "--layouts", "sp=2", "--work", str(tmp_path / "w")]) == 2
    assert "--layouts ('sp=2'): 'sp=2' must be KEY=N" in capsys.readouterr().err
    assert main(["verify", "--config", "tiny", "--layouts", "ep=3", "--work", str(tmp_path / "w")]) == 2
    assert "layout dp=3,ep=3: parallel.ep (3) must divide moe.num_experts (8)" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_the_command_prints_the_table_writes_json_and_exits_1_naming_the_first_failure(monkeypatch, capsys,
                                                                                        tmp_path):
    from moetrain.cli import main
    from moetrain.verify import driver

    works = []

    def fake_run(plan, *, work=None, say=print, checks=driver.CHECKS):
        works.append(work)
        (work / "layout0").mkdir()  # the runs, about 1 GB in a real verification
        out = Comparison()
        out.values("[dp=2,ep=2] loss", 1.0, 1.0, EXACT, step=1)
        if len(works) == 1:
            out.values("[dp=2,ep=2] grad_norm", 2.0, 1.0, EXACT, step=2)
            out.values("[dp=2,ep=2] aux_loss", 2.0, 1.0, EXACT, step=1)
        return out

    monkeypatch.setattr(driver, "run_verification", fake_run)
    code = main(["verify", "--config", "tiny", "--layouts", "ep=2", "--json", str(tmp_path / "v.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert "model.num_layers: 4 -> 2" in out and "moe.router_noise_std" in out  # the changes and exclusions
    assert out.strip().splitlines()[-1].startswith("verify: FAIL: [dp=2,ep=2] aux_loss")  # step 1 before step 2
    doc = json.loads((tmp_path / "v.json").read_text())
    assert not doc["passed"] and doc["layouts"] == ["dp=2,ep=2"]
    assert [r["status"] for r in doc["results"]] == ["PASS", "FAIL", "FAIL"]
    # A failed verification keeps its runs and says where; a passed one leaves no temporary folder.
    assert f"runs and logs kept in {works[0]}" in out and (works[0] / "layout0").is_dir()
    assert main(["verify", "--config", "tiny", "--layouts", "ep=2"]) == 0
    assert not works[1].exists() and "kept" not in capsys.readouterr().out
    shutil.rmtree(works[0])


def test_an_init_from_export_is_cut_to_the_shrunk_model_block_by_kind(tmp_path):
    from moetrain.interop.export import write_export
    from moetrain.models.transformer import Transformer
    from moetrain.train.init_from import load_initial_weights
    from moetrain.utils.safetensors_io import SafetensorsFolder
    from moetrain.verify.init_export import PLACEHOLDER, cut_export, shrunk_vocab_size, source_blocks

    # Blocks 0, 1 dense, 2, 3 MoE at dim 128; the shrunk job: block 0 dense, blocks 1, 2 MoE at dim 64.
    full = load_config("tiny", ["--model.moe_layer_offset=2", "--data.tokenizer=bytes"])
    torch.manual_seed(0)
    write_export(tmp_path / "full", config={}, state_dict=Transformer(full.model.with_vocab_size(300),
                                                                      moe=full.moe).state_dict())
    small, changes = shrink_job(replace(full, checkpoint=replace(full.checkpoint, init_from=str(tmp_path / "full"))),
                                pps=[1], cpu=True)
    assert small.checkpoint.init_from == PLACEHOLDER and "checkpoint.init_from" in {c.field for c in changes}
    assert source_blocks(small.model, full.model) == {0: 0, 1: 2, 2: 3}
    cut = cut_export(tmp_path / "full", job=small, original=full.model, out_dir=tmp_path / "cut")
    src, got = SafetensorsFolder(tmp_path / "full"), SafetensorsFolder(cut)
    assert torch.equal(got.get("tok_embeddings.weight"), src.get("tok_embeddings.weight")[:256, :64])
    w1 = next(n for n in got.names() if n.startswith("layers.1.") and "experts" in n)
    want = src.get(w1.replace("layers.1.", "layers.2.", 1))
    assert torch.equal(got.get(w1), want[tuple(slice(0, n) for n in got.get(w1).shape)])
    model = Transformer(small.model.with_vocab_size(shrunk_vocab_size(small)), moe=small.moe)
    load_initial_weights(model, cut)  # the trainer's loader takes it: every name and shape matches
    assert all(torch.equal(v, got.get(k)) for k, v in model.state_dict().items())
    # An export narrower than the shrunk model cannot be cut: refused naming the tensor.
    narrow = load_config("tiny", ["--model.dim=32", "--model.num_heads=2", "--model.moe_layer_offset=2",
                                  "--data.tokenizer=bytes"])
    write_export(tmp_path / "narrow", config={}, state_dict=Transformer(narrow.model.with_vocab_size(300),
                                                                        moe=narrow.moe).state_dict())
    with pytest.raises(ValueError, match=r"tok_embeddings.weight: shape \(300, 32\) cannot be cut to \(256, 64\)"):
        cut_export(tmp_path / "narrow", job=small, original=narrow.model, out_dir=tmp_path / "cut2")


def test_a_deepspeed_job_is_shrunk_and_keeps_its_offload_where_the_stage_allows():
    from moetrain.verify.driver import offload_overrides, plan_verification

    ds = load_config("tiny", [], deepspeed="tests/fixtures/ds_zero3_moe.json", world_size=1)
    plan = plan_verification(ds, layouts=parse_layouts("ep=2,zero=3; ep=2"), steps=1, shrink=True, cpu=True)
    # The DeepSpeed micro-batch (64 / 4 = 16 per process) is derived per layout like the accumulation.
    assert plan.cfg.train.micro_batch_size == 4 and plan.cfg.train.dtype == "fp16"
    off = ["--zero.offload_param=none", "--zero.offload_optimizer=none"]
    assert offload_overrides(plan.cfg, Layout()) == off  # world 1 runs at stage 0
    assert offload_overrides(plan.cfg, plan.layouts[0]) == [] and offload_overrides(plan.cfg, plan.layouts[1]) == off


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_export_round_trip_holds_a_router_bias_to_the_router_bias_bound(dtype):
    # The HF export compares every model tensor in one row; a selection bias moves by its update rate
    # per step (a flipped routing choice flips its sign in bf16), not by lr, and is exact in fp32.
    from moetrain.verify.driver import _state_tol, model_bounds, plan_verification

    cfg = load_config("deepseek-v3", [f"--train.dtype={dtype}"])
    plan = plan_verification(cfg, layouts=parse_layouts("ep=2"), steps=3, shrink=True, cpu=True)
    precision = Precision(dtype)
    weight, bias = "model.layers.1.attention.wo.weight", "model.layers.1.feed_forward.router.expert_bias"
    want = {weight: torch.zeros(6), bias: torch.zeros(4)}
    bounds = model_bounds([bias, weight], want, plan, precision, 3)
    rate, lr = plan.cfg.moe.router_bias_update_rate, plan.cfg.optim.lr
    bias_abs = 2 * rate * 3 if dtype == "bf16" else 0.0
    assert _state_tol("router bias", plan, precision, 3).abs == bias_abs
    param_abs = _state_tol("parameters", plan, precision, 3).abs
    assert param_abs == (2 * lr * 3 if dtype == "bf16" else 0.02 * lr * 3)
    assert bounds is not None and bounds.tolist() == [bias_abs] * 4 + [param_abs] * 6
    assert bias_abs != param_abs


def test_bf16_moments_loosen_only_the_slices_of_experts_whose_counts_differ():
    # World 1 routes an even share to each of 4 experts; the layout moves one copy from expert 1 to
    # expert 2 (a bf16 routing flip). Their rows of the expert and router tensors get 3x their own
    # largest entry; expert 0's rows and every other tensor keep 0.2 of the tensor's largest entry.
    from moetrain.verify.driver import Plan, compare_state
    from moetrain.verify.flips import flipped_experts

    cfg = load_config("tiny", ["--train.dtype=bf16", "--moe.num_experts=4", "--moe.top_k=2"])
    plan, precision = Plan(cfg, [], [], 1), Precision("bf16")
    routed = cfg.train.global_batch_size * cfg.data.seq_len * cfg.moe.top_k
    counts = torch.full((1, 4), routed / 4)
    moved = counts + torch.tensor([[0.0, -1.0, 1.0, 0.0]])
    flips = flipped_experts({1: {"expert_share": (moved / routed).tolist()}},
                            {1: {"expert_share": (counts / routed).tolist()}}, routed_L=[routed], up_to=1)
    assert flips.num_layers == 1 and flips.pairs == {(0, 1), (0, 2)}
    prefix = "optim.state.layers.1.feed_forward"
    want = {f"{prefix}.experts.w1.exp_avg": torch.ones(4, 2, 2),
            f"{prefix}.router.gate.weight.exp_avg": torch.ones(4, 3),
            "optim.state.layers.1.attention.wo.weight.exp_avg": torch.ones(3, 3)}

    def moments(changed: dict[str, torch.Tensor]) -> Comparison:
        out = Comparison()
        compare_state(out, "", {**want, **changed}, want, plan, precision, step=1, flips=flips)
        return out

    def off(row: int, by: float) -> torch.Tensor:  # one entry of one expert's row moved by `by` of the max
        t = torch.ones(4, 2, 2)
        t[row, 0, 1] += by
        return t

    w1 = f"{prefix}.experts.w1.exp_avg"
    r = moments({w1: off(1, 0.5)}).results[0]
    assert r.ok and r.max_rel == 0.0 and r.note.startswith("4 expert rows loosened")  # 2 flipped x 2 tensors
    assert not moments({w1: off(0, 0.5)}).results[0].ok  # expert 0's counts are equal: 0.2 holds
    assert not moments({w1: off(1, 4.0)}).results[0].ok  # a flipped slice is held to 3x its own size
    assert not moments({w1: 2 * want[w1]}).results[0].ok  # a missing 1/ep doubles every expert's rows
    assert not moments({"optim.state.layers.1.attention.wo.weight.exp_avg": 1.5 * torch.ones(3, 3)}).results[0].ok
    plain = Comparison()  # fp32 (no flips passed): the flipped expert's 0.5 fails
    compare_state(plain, "", {**want, w1: off(1, 0.5)}, want, plan, Precision("fp32"), step=1)
    assert not plain.results[0].ok


MTP_JOB = ["--model.mtp_depth=2", "--model.dense_layers=[0]", "--model.vocab_size=512", "--data.vocab_size=512",
           "--data.seq_len=8", "--train.global_batch_size=2", "--train.micro_batch_size=2"]
"""tiny with a dense block 0, three MoE blocks and two multi-token modules, 2 sequences of 8 tokens:
per step 2 * 8 * 2 = 32 routed copies in a main MoE layer, 2 * 7 * 2 = 28 at depth 1, 24 at depth 2."""


@pytest.mark.parametrize("keep_length", [False, True])
def test_each_logged_layer_counts_its_own_routed_copies_mtp_depth_k_its_s_minus_k_positions(keep_length):
    # One real training step; the balancer's integer counts are the reference the logged shares and
    # drop fractions must come back to. keep_length (set by tensor parallelism, which refuses a
    # capacity factor with multi-token modules) routes the same copies.
    from moetrain.models.transformer import Transformer
    from moetrain.train.balancing import install_balancing
    from moetrain.train.optim import build_optimizer
    from moetrain.verify.checks import routed_counts

    cfg = load_config("tiny", [*MTP_JOB, *([] if keep_length else ["--moe.capacity_factor=1.0"])])
    model = Transformer(cfg.model, moe=cfg.moe, seed=0)
    for module in model.mtp:
        module.keep_length = keep_length
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    balancer = install_balancing(opt, model)
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, ids).total_loss.backward()
    opt.step()
    counts_LE, dropped_L = balancer.window_routed_LE.double().clone(), balancer.window_local_L4[:, 0].clone()
    m = balancer.metrics()

    routed = routed_counts(cfg)
    assert routed["expert_share"] == [32, 32, 32, 28, 24] == counts_LE.sum(dim=1).tolist()
    assert routed["dropped_fraction"] == routed["expert_share"]  # token choice: copies, not tokens
    assert torch.equal(counts_from_shares(m["expert_share"], routed["expert_share"]), counts_LE)
    assert (dropped_L.sum() > 0) is not keep_length  # with a capacity some copies are dropped
    assert torch.equal(counts_from_shares(m["dropped_fraction"], routed["dropped_fraction"]), dropped_L)


def test_a_one_copy_flip_in_a_multi_token_layer_is_one_count_at_its_layer_and_experts():
    # World 1's counts by layer; the layout moves one copy of depth 2's layer (row 4, 24 copies) from
    # expert 0 to expert 1 and drops 2 more of its copies. Scaled by the main layers' 32 copies those
    # would read as 3 -> 1 and 5 -> 7, and 3 drops.
    from moetrain.verify.checks import routed_counts
    from moetrain.verify.driver import Plan, _routing_tol, compare_step
    from moetrain.verify.flips import flipped_experts

    cfg = load_config("tiny", MTP_JOB)
    plan = Plan(cfg, [], [], 1)
    routed_L = torch.tensor([32.0, 32.0, 32.0, 28.0, 24.0])
    counts_LE = torch.tensor([[4.0] * 8] * 3 + [[4.0, 3.0] * 4] + [[2.0, 4.0] + [3.0] * 6])
    moved_LE = counts_LE.clone()
    moved_LE[4, :2] = torch.tensor([1.0, 5.0])
    dropped_L = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0])

    def record(counts, dropped) -> dict:
        return {"expert_share": [[round(v, 5) for v in row] for row in (counts / routed_L[:, None]).tolist()],
                "dropped_fraction": [round(v, 5) for v in (dropped / routed_L).tolist()]}

    want, got = record(counts_LE, torch.zeros(5)), record(moved_LE, dropped_L)
    for precision, ok in ((Precision("fp32"), False), (Precision("bf16"), True)):
        out = Comparison()
        compare_step(out, "", got, want, plan, precision, step=1)
        rows = {r.quantity.strip(): r for r in out.results}
        assert rows["tokens per expert"].max_abs == 1.0 and rows["tokens per expert"].ok is ok
        assert rows["dropped tokens"].max_abs == 2.0 and rows["dropped tokens"].ok is ok
    same = Comparison()
    compare_step(same, "", want, want, plan, Precision("fp32"), step=1)
    assert all(r.ok for r in same.results)
    flips = flipped_experts({1: got}, {1: want}, routed_L=routed_counts(cfg)["expert_share"], up_to=1)
    assert flips.num_layers == 5 and flips.pairs == {(4, 0), (4, 1)}
    tol, bound_L = _routing_tol(Precision("bf16"), [4096, 4064])  # 1% of each layer's own copies
    assert bound_L is not None and bound_L.tolist() == pytest.approx([40.96, 40.64]) and tol.abs == bound_L.max()
