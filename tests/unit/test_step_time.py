"""The step-time model: its breakdown adds up, bandwidth and overlap rules worked by hand, MFU of a
hand-counted model, profiles and their sources, calibration files."""

import ast
import itertools
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from moetrain.config.loader import load_config
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.presets import get_preset
from moetrain.plan.calibrate import profile_from_measurement
from moetrain.plan.comm import comm_per_step
from moetrain.plan.model_states import Layout, param_specs, state_bytes_per_rank
from moetrain.plan.step_time import (
    H100_SXM,
    H200,
    DeviceProfile,
    Link,
    estimate_for_config,
    estimate_step_time,
    load_profile,
    step_work,
)

SOURCE = Path(__file__).resolve().parents[2] / "moetrain" / "plan" / "device_profiles.py"


def _tiny(vocab=4096):
    p = get_preset("tiny")
    return replace(p.model, vocab_size=vocab, preset=None), p.moe


def _profile(*, bandwidth=1e9, latency=0.0, overlap=1.0, peak=1e12) -> DeviceProfile:
    link = Link(bandwidth=bandwidth, latency=latency)
    return DeviceProfile(name="test", peak_flops={"fp32": peak}, gemm_efficiency=1.0, expert_gemm_efficiency=1.0,
                         attention_efficiency=1.0, memory_bandwidth=1e30, optimizer_bandwidth=1e30,
                         intra_node=link, inter_node=replace(link, bandwidth=bandwidth / 10), comm_overlap=overlap)


def _estimate(layout, profile, *, micro=8, accum=1, **kw):
    model, moe = _tiny()
    return estimate_step_time(param_specs(model, moe), layout, model, moe, micro_batch_size=micro, seq_len=256,
                              grad_accum=accum, profile=profile, **kw)


@pytest.mark.parametrize("layout", [Layout(world=2, ep=1, zero_stage=0), Layout(world=2, ep=2, zero_stage=1),
                                    Layout(world=4, ep=2, zero_stage=2), Layout(world=4, ep=4, zero_stage=3)])
def test_breakdown_adds_up(layout):
    est = _estimate(layout, H100_SXM, accum=2, ac="full")
    d = est.as_dict()
    assert d["step_s"] == pytest.approx(d["forward_s"] + d["backward_s"] + sum(d["exposed_s"].values())
                                        + d["optimizer_s"] + d["sync_s"] + d["host_s"], rel=1e-12)
    for c, t in est.comm_s.items():
        assert 0.0 <= est.exposed_s[c] <= t + 1e-15
    assert est.tokens_per_s == pytest.approx(8 * 256 * 2 * layout.world / est.step_s)


def test_small_collectives_and_expert_parallel_host_work_by_hand():
    model, moe = _tiny()
    num_moe, num_expert_tensors = len(model.moe_layer_ids), sum(1 for s in param_specs(model, moe) if s.expert)
    assert num_moe == 4 and num_expert_tensors == 4 * 2  # gelu experts: w1 and w2
    prof = replace(_profile(latency=1e-3), host_sync_s=2e-6, ep_layer_host_s=3e-4, dtensor_param_host_s=5e-5)
    dp = _estimate(Layout(world=2, ep=1, zero_stage=0), prof, accum=2)
    ep = _estimate(Layout(world=2, ep=2, zero_stage=0), prof, accum=2)
    # Norm and step agreement, and one routing-count all-reduce per MoE layer and micro-batch.
    assert dp.sync_s == pytest.approx((2 + 4 * 2) * 1e-3, rel=1e-12) and dp.host_s == 0.0
    # ep adds one split-size sync and the dispatcher's host work per MoE layer and micro-batch, and
    # the DTensor dispatch of every expert tensor in the optimizer step (in series on a CPU).
    assert ep.sync_s == pytest.approx(dp.sync_s + 4 * 2 * (2e-6 + 3e-4), rel=1e-12)
    assert ep.host_s == pytest.approx(8 * 5e-5, rel=1e-12)
    hidden = _estimate(Layout(world=2, ep=2, zero_stage=0), replace(prof, host_async=True), accum=2)
    assert hidden.host_s == 0.0 and hidden.sync_s == ep.sync_s  # host work hides; the syncs do not
    assert _estimate(Layout(world=1, ep=1, zero_stage=0), prof).sync_s == 0.0


def test_multi_token_depths_add_all_to_all_calls_bytes_and_syncs():
    """Each depth of model.mtp_depth is one more MoE layer: 5 all-to-all calls, a routing-count
    all-reduce and a split-size sync per micro-batch, and the bytes of ``comm_per_step`` at its
    S - k positions per sequence."""
    model, moe = _tiny()
    mtp = replace(model, mtp_depth=2)
    layout, prof = Layout(world=2, ep=2, zero_stage=0), replace(_profile(latency=1e-3), host_sync_s=2e-6)
    est = estimate_step_time(param_specs(mtp, moe), layout, mtp, moe, micro_batch_size=8, seq_len=256, grad_accum=1,
                             profile=prof)
    vol = comm_per_step(param_specs(mtp, moe), layout, mtp, moe, tokens_per_micro_batch=8 * 256, grad_accum=1,
                        compute_bytes=4, seq_len=256)
    trunk = comm_per_step(param_specs(model, moe), layout, model, moe, tokens_per_micro_batch=8 * 256, grad_accum=1,
                          compute_bytes=4)
    assert vol.all_to_all == trunk.all_to_all * (4 * 256 + 255 + 254) / (4 * 256)
    assert est.comm_s["all_to_all"] == pytest.approx(vol.all_to_all / 1e9 + (4 + 2) * 5 * 1e-3)
    assert est.sync_s == pytest.approx((2 + 6) * 1e-3 + 6 * 2e-6, rel=1e-12)


def test_doubling_bandwidth_halves_communication():
    layout = Layout(world=4, ep=2, zero_stage=2)
    slow, fast = _estimate(layout, _profile(bandwidth=1e9)), _estimate(layout, _profile(bandwidth=2e9))
    assert set(slow.comm_s) == {"all_to_all", "all_reduce", "reduce_scatter", "all_gather"}
    assert slow.comm_s["all_to_all"] > 0 and slow.comm_s["all_gather"] > 0
    for c in slow.comm_s:
        assert fast.comm_s[c] == pytest.approx(slow.comm_s[c] / 2, rel=1e-12)
    assert fast.compute_s == slow.compute_s


def test_communication_is_comm_bytes_over_bandwidth_plus_latency():
    model, moe = _tiny()
    layout = Layout(world=2, ep=2, zero_stage=0)
    est = _estimate(layout, _profile(bandwidth=1e9, latency=1e-3))
    vol = comm_per_step(param_specs(model, moe), layout, model, moe, tokens_per_micro_batch=8 * 256, grad_accum=1,
                        compute_bytes=4)
    # 4 MoE layers x (3 forward + 2 backward calls): counts, dispatch, combine; their gradients.
    assert est.comm_s["all_to_all"] == pytest.approx(vol.all_to_all / 1e9 + 4 * 5 * 1e-3)
    assert est.exposed_s["all_to_all"] == est.comm_s["all_to_all"]  # one chunk: the layer waits


def test_a_reduction_shorter_than_the_backward_hides_except_its_last_bucket():
    layout = Layout(world=2, ep=1, zero_stage=0)
    model, moe = _tiny()
    grad_bytes = sum(s.numel * 4 for s in param_specs(model, moe))
    cap = 2 << 20
    est = _estimate(layout, _profile(bandwidth=1e12, peak=1e9), bucket_cap_bytes=cap)
    assert est.comm_s["all_reduce"] < est.backward_s
    # Buckets of 1 MiB (the first), then 2 MiB: the last one holds what is left.
    last = (grad_bytes - (1 << 20)) % cap or cap
    assert est.exposed_s["all_reduce"] == pytest.approx(est.comm_s["all_reduce"] * last / grad_bytes)
    # A backward too short to hide it: all that does not fit under the backward shows.
    fast = _estimate(layout, _profile(bandwidth=1e9, peak=1e15), bucket_cap_bytes=cap)
    assert fast.exposed_s["all_reduce"] == pytest.approx(fast.comm_s["all_reduce"] - fast.backward_s)
    # Overlap that does not work (comm_overlap 0) hides nothing.
    none = _estimate(layout, _profile(bandwidth=1e12, peak=1e9, overlap=0.0), bucket_cap_bytes=cap)
    assert none.exposed_s["all_reduce"] == none.comm_s["all_reduce"]


def test_chunked_dispatch_hides_all_but_one_chunk_behind_the_experts():
    layout = Layout(world=2, ep=2, zero_stage=0)
    est = _estimate(layout, _profile(bandwidth=1e12, peak=1e9), dispatch_chunks=4)
    assert est.exposed_s["all_to_all"] == pytest.approx(est.comm_s["all_to_all"] / 4)


@pytest.mark.parametrize(("setting", "per_layer", "per_recompute"), [
    ({"dispatch_chunks": 4}, 17, 9),
    ({"dispatch_chunks": 2, "dispatch_dedup": True}, 16, 10),
    ({"capacity_factor": 1.25}, 4, 2),
])
def test_all_to_all_latencies_follow_chunks_and_routing(setting, per_layer, per_recompute):
    """One latency per all-to-all call: C = 4 chunks make 1 + 4 * 4 per layer (the counts once, then
    each chunk's dispatch and combine, forward and backward), dedup adds the unique-row counts once
    and per chunk the gate weights, row indices and their gradient; a capacity factor at C = 1 sends
    no counts (an all-gather decides the drops). tests/integration/test_a2a_calls.py counts them."""
    model, moe = _tiny()
    moe = replace(moe, **setting)
    layout, prof = Layout(world=2, ep=2, zero_stage=0), _profile(latency=1e-3)
    num_moe = len(model.moe_layer_ids)
    for ac, recomputed in (("none", 0), ("moe", num_moe)):
        est = estimate_step_time(param_specs(model, moe), layout, model, moe, micro_batch_size=8, seq_len=256,
                                 grad_accum=1, profile=prof, ac=ac, dispatch_chunks=moe.dispatch_chunks)
        vol = comm_per_step(param_specs(model, moe), layout, model, moe, tokens_per_micro_batch=8 * 256,
                            grad_accum=1, compute_bytes=4, ac_moe_layers_recomputed=recomputed)
        latency = (per_layer * num_moe + per_recompute * recomputed) * 1e-3
        assert est.comm_s["all_to_all"] == pytest.approx(vol.all_to_all / 1e9 + latency)


def test_an_all_to_all_across_nodes_runs_at_the_inter_node_link():
    model, moe = _tiny()
    within = _estimate(Layout(world=4, ep=2, zero_stage=0), _profile(), procs_per_node=2)
    across = _estimate(Layout(world=4, ep=4, zero_stage=0), _profile(), procs_per_node=2)
    vol = comm_per_step(param_specs(model, moe), Layout(world=4, ep=4, zero_stage=0), model, moe,
                        tokens_per_micro_batch=8 * 256, grad_accum=1, compute_bytes=4, procs_per_node=2)
    assert across.comm_s["all_to_all"] == pytest.approx(vol.all_to_all / 1e8)
    assert within.comm_s["all_to_all"] < across.comm_s["all_to_all"]


def test_flops_and_mfu_of_a_hand_counted_model():
    # vocab 16, dim 8, 1 block of 2 heads, 2 gelu experts of hidden 16, top-1, tied head; S = 4.
    model = ModelConfig(vocab_size=16, dim=8, num_layers=1, num_heads=2, max_seq_len=4, moe_every=1,
                        activation="gelu", tie_embeddings=True)
    moe = MoEConfig(num_experts=2, top_k=1, expert_hidden_dim=16, activation="gelu")
    work = step_work(model, moe, micro_batch_size=3, seq_len=4, grad_accum=1)
    tokens = 12
    # Forward per token: wq wk wv wo 4*64, router 16, head 128 -> 2*400; one expert 2*8*16 -> 2*256;
    # attention 2 * S * D = 64. Backward: 2x the GEMMs, 2.5x attention.
    assert work.dense_gemm_flops == (tokens * 800, tokens * 1600)
    assert work.expert_gemm_flops == (tokens * 512, tokens * 1024)
    assert work.attention_flops == (tokens * 64, tokens * 160)
    layout = Layout(world=1, ep=1, zero_stage=0)
    p = _profile(peak=1e6)
    est = estimate_step_time(param_specs(model, moe), layout, model, moe, micro_batch_size=3, seq_len=4,
                             grad_accum=1, profile=p)
    assert est.compute_s == pytest.approx(tokens * (800 + 1600 + 512 + 1024 + 64 + 160) / 1e6)
    # MFU counts model FLOPs as the trainer does: 6 * the active parameters (attention 256, router
    # 16, one expert 256, tied head 128, norm weights 24) + 12 * L * D * S = 4464.
    assert est.flops_per_token == 6 * 680 + 12 * 1 * 8 * 4 == 4464
    assert est.mfu == pytest.approx(tokens / est.step_s * 4464 / 1e6)


def test_recompute_adds_the_checkpointed_forward():
    model, moe = _tiny()
    plain = step_work(model, moe, micro_batch_size=8, seq_len=256, grad_accum=1)
    full = step_work(model, moe, micro_batch_size=8, seq_len=256, grad_accum=1, ac="full")
    moe_only = step_work(model, moe, micro_batch_size=8, seq_len=256, grad_accum=1, ac="moe")
    assert full.expert_gemm_flops[1] == plain.expert_gemm_flops[1] + plain.expert_gemm_flops[0]
    assert full.attention_flops[1] == plain.attention_flops[1] + plain.attention_flops[0]
    head = 2 * 128 * 4096 * 8 * 256  # the head's forward is not recomputed
    assert full.dense_gemm_flops[1] == plain.dense_gemm_flops[1] + plain.dense_gemm_flops[0] - head
    assert moe_only.attention_flops == plain.attention_flops
    assert moe_only.expert_gemm_flops[1] == full.expert_gemm_flops[1]
    assert full.elementwise_bytes[1] > plain.elementwise_bytes[1]


def test_gpu_defaults_name_their_sources():
    tree = ast.parse(SOURCE.read_text())
    docs = {}
    for a, b in itertools.pairwise(tree.body):
        if isinstance(a, ast.Assign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.targets[0].id] = b.value.value
    for word in ("datasheet", "989", "3.35 TB/s", "NVLink 4", "450 GB/s", "400 Gb/s", "InfiniBand NDR", "Assumed"):
        assert word in docs["H100_SXM"], word
    assert "4.8 TB/s" in docs["H200"] and "datasheet" in docs["H200"]
    assert H200.memory_bandwidth > H100_SXM.memory_bandwidth and H200.peak("bf16") == H100_SXM.peak("bf16")


def test_calibration_files_round_trip_and_name_what_is_missing(tmp_path):
    measured = {"peak": 50e9, "dense": 40e9, "expert": 30e9, "attention": 20e9, "elementwise_bandwidth": 5e9,
                "optimizer_bandwidth": 2e9, "threads_per_rank": 1, "overlap": 0.25, "op_overhead_s": 7e-6,
                "procs": 2, "cpu_count": 1, "ep_layer_host_s": 3e-3, "dtensor_param_host_s": 2e-4,
                "collectives": {"all_reduce": [1e9, 1e-4], "all_to_all": [2e9, 5e-5],
                                "all_gather": [1e9, 1e-4], "reduce_scatter": [1e9, 1e-4]}}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"profiles": {"2": profile_from_measurement(measured)}}))
    p = load_profile(str(path), procs_per_node=2)
    assert p.gemm_efficiency == 0.8 and p.expert_gemm_efficiency == 0.6 and p.comm_overlap == 0.25
    assert p.op_overhead_s == 7e-6 and not p.host_async  # a CPU's host work runs on the cores that compute
    assert (p.ep_layer_host_s, p.dtensor_param_host_s) == (3e-3, 2e-4)
    assert p.core_share == 0.5  # two single-thread ranks on one core
    assert p.intra_node.seconds("all_to_all", 2e9, 2) == pytest.approx(1 + 1e-4)
    assert p.intra_node.seconds("all_reduce", 2e9, 2) == pytest.approx(2 + 2e-4)
    assert DeviceProfile.from_dict(json.loads(json.dumps(asdict(p)))) == p
    with pytest.raises(ValueError, match=r"--nproc per node \(4\) was not calibrated"):
        load_profile(str(path), procs_per_node=4)
    with pytest.raises(ValueError, match="--device-profile"):
        load_profile("a100", procs_per_node=1)
    with pytest.raises(ValueError, match=r"train.dtype \('bf16'\)"):
        p.peak("bf16")


def test_config_layouts_and_what_is_not_modelled():
    cfg = load_config("tiny", ["--parallel.ep=2", "--parallel.zero_stage=2"])
    est = estimate_for_config(cfg, world=2, profile=H200)
    assert est.comm_s["reduce_scatter"] > 0 and est.comm_s["all_to_all"] > 0 and est.comm_s["all_reduce"] == 0
    assert 0 < est.mfu < 1 and math.isfinite(est.step_s)
    off = load_config("tiny", ["--parallel.zero_stage=2", "--zero.offload_optimizer=cpu"])
    with pytest.raises(ValueError, match="offload"):
        estimate_for_config(off, world=2, profile=H200)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_weight_average_adds_its_lerp_to_the_optimizer_time(stage):
    """optim.ema_decay: 12 bytes per averaged element (read the average and the weight, write the
    average) at the optimizer bandwidth, over the elements this rank averages; nothing else moves."""
    cfg = load_config("tiny", ["--parallel.ep=2", f"--parallel.zero_stage={stage}"])
    averaged = load_config("tiny", ["--parallel.ep=2", f"--parallel.zero_stage={stage}", "--optim.ema_decay=0.99"])
    plain, est = estimate_for_config(cfg, world=4, profile=H200), estimate_for_config(averaged, world=4, profile=H200)
    model, moe = _tiny(cfg.data.vocab_size)
    states = state_bytes_per_rank(param_specs(model, moe), Layout(world=4, ep=2, zero_stage=stage,
                                                                  weight_average=True))
    average_bytes = max(states, key=lambda s: s.total).average
    assert average_bytes > 0
    assert est.optimizer_s - plain.optimizer_s == pytest.approx(average_bytes / 4 * 12 / H200.optimizer_bandwidth,
                                                                rel=1e-9)
    assert (est.forward_s, est.backward_s, est.comm_s, est.sync_s) == (
        plain.forward_s, plain.backward_s, plain.comm_s, plain.sync_s)


@pytest.mark.slow
@pytest.mark.slow  # two spawned gloo processes: the multi-process tier's, not the unit tier's
def test_calibration_measures_two_real_processes(tmp_path):
    from moetrain.plan.calibrate import main

    out = tmp_path / "cal.json"
    assert main(["--out", str(out), "--procs", "2", "--repeats", "1"]) == 0
    p = load_profile(str(out), procs_per_node=2)
    assert p.name == "cpu" and p.threads_per_rank >= 1 and 0.0 <= p.comm_overlap <= 1.0
    assert 1e-7 < p.op_overhead_s < 1e-3 and not p.host_async
    # The fused optimizer step over ep-sharded experts costs little more than over plain tensors:
    # well under torch's per-tensor AdamW (0.2-0.3 ms per expert DTensor at 2 processes).
    assert 0.0 <= p.ep_layer_host_s < 0.1 and 0.0 <= p.dtensor_param_host_s < 0.1
    assert p.peak("fp32") > 0 and p.gemm_efficiency > 0 and p.memory_bandwidth > 0
    assert set(p.intra_node.by_collective) == {"all_reduce", "all_to_all", "all_gather", "reduce_scatter"}
    assert all(bw > 0 and lat > 0 for bw, lat in p.intra_node.by_collective.values())


def _tiny_mla():
    model, moe = _tiny()
    return replace(model, attention="mla", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, moe_layer_offset=1), replace(moe, num_shared_experts=1)


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("which", ["tiny", "mla-dense-first", "deepseek-v3"])
def test_step_gemm_flops_are_the_models_flops_per_token_with_the_multi_token_depths(which, depth):
    """The planner's GEMM FLOPs of a step (forward + backward) against the model's own
    ``flops_per_token`` (6 x the active matmul parameters, its attention term taken out): the same
    but for the norm weights, which the planner counts as elementwise work, and the multi-token
    depths, which the model counts at all S positions and the planner at the S - k that have a
    token k places ahead."""
    from moetrain.models.transformer import flops_per_token

    if which == "deepseek-v3":
        cfg = load_config("deepseek-v3", [])
        model, moe = cfg.model, cfg.moe
    else:
        model, moe = _tiny() if which == "tiny" else _tiny_mla()
    model = replace(model, mtp_depth=depth)
    micro, S, accum = 2, 128, 3
    D, L, H = model.dim, model.num_layers, model.num_heads
    A = model.resolved_head_dim
    U = model.v_head_dim if model.attention == "mla" else A

    def gemm_per_token(m):  # 6 x the matmul parameters the model counts, its attention term out
        return flops_per_token(m, moe, seq_len=S) - 6 * (L + m.mtp_depth) * H * (A + U) * S

    trunk = gemm_per_token(replace(model, mtp_depth=0)) - 6 * (2 * L * D + D)  # block norms, final norm
    per_depth = (gemm_per_token(model) - gemm_per_token(replace(model, mtp_depth=0))) / max(depth, 1) \
        - 6 * (2 * D + 3 * D)  # a depth's block norms, hnorm, enorm, norm
    shares = [(S - k) / S for k in range(1, depth + 1)]
    work = step_work(model, moe, micro_batch_size=micro, seq_len=S, grad_accum=accum)
    tokens = micro * S * accum
    planned = sum(work.dense_gemm_flops) + sum(work.expert_gemm_flops)
    assert planned == pytest.approx(tokens * (trunk + per_depth * sum(shares)), rel=1e-12)
    # Attention: 2 * positions * D per token forward, 2.5x backward; a depth over S - k positions.
    attention = 2 * D * (L * S + sum(share * (S - k) for k, share in enumerate(shares, start=1)))
    assert sum(work.attention_flops) == pytest.approx(tokens * 3.5 * attention, rel=1e-12)
    if depth:
        # The compute time grows with the depths: MFU (whose model FLOPs count them) no longer rises.
        base = step_work(replace(model, mtp_depth=0), moe, micro_batch_size=micro, seq_len=S, grad_accum=accum)
        assert sum(work.dense_gemm_flops) > sum(base.dense_gemm_flops)


def test_moe_checkpointing_recomputes_the_multi_token_depths_moe_ffn():
    """ac "moe" checkpoints every MoE layer, the depths' too (at their S - k positions); "full"
    only the trunk's blocks."""
    model, moe = _tiny()
    mtp, S = replace(model, mtp_depth=1), 256
    work = {(m.mtp_depth, ac): step_work(m, moe, micro_batch_size=2, seq_len=S, grad_accum=1, ac=ac)
            for m in (model, mtp) for ac in ("none", "moe", "full")}

    def recomputed(depth, ac):
        return work[(depth, ac)].expert_gemm_flops[1] - 2 * work[(depth, ac)].expert_gemm_flops[0]

    assert recomputed(1, "moe") == pytest.approx(recomputed(0, "moe") * (1 + (S - 1) / S / len(model.moe_layer_ids)))
    assert recomputed(1, "full") == pytest.approx(recomputed(0, "full"))


def test_expert_choice_routes_its_capacity_above_a_factor_of_one():
    """Expert choice with capacity factor f routes E * ceil(f * T * K / E) copies (the MoE layer's own
    ``capacity``), f = 2 twice the copies of token choice; token choice keeps min(1, f) of T * K."""
    from moetrain.models.moe.layer import MoELayer

    model, moe = _tiny()
    ec = replace(moe, router="expert_choice", capacity_factor=2.0)
    micro, S = 2, 100
    T = micro * S
    layer = MoELayer(model.dim, ec)
    copies = ec.num_experts * layer.capacity(T)
    assert copies == 2 * T * moe.top_k
    plain = step_work(model, moe, micro_batch_size=micro, seq_len=S, grad_accum=1)
    work = step_work(model, ec, micro_batch_size=micro, seq_len=S, grad_accum=1)
    assert work.expert_gemm_flops[0] == pytest.approx(plain.expert_gemm_flops[0] * copies / (T * moe.top_k))
    capped = step_work(model, replace(moe, capacity_factor=2.0), micro_batch_size=micro, seq_len=S, grad_accum=1)
    assert capped.expert_gemm_flops == plain.expert_gemm_flops


def test_dedup_adds_its_metadata_all_to_alls():
    """moe.dispatch_dedup: per MoE layer 9 all-to-alls instead of 5 (the unique-row counts, the gate
    weights and row indices forward, the weights' gradient backward), 6 per recompute instead of 3,
    each one latency; the bytes are ``comm_per_step``'s."""
    model, moe = _tiny()
    dedup = replace(moe, dispatch_dedup=True)
    layout, prof = Layout(world=2, ep=2, zero_stage=0), _profile(latency=1e-3)
    num_moe = len(model.moe_layer_ids)
    for ac, recomputed in (("none", 0), ("moe", num_moe)):
        est = estimate_step_time(param_specs(model, dedup), layout, model, dedup, micro_batch_size=8, seq_len=256,
                                 grad_accum=1, profile=prof, ac=ac)
        vol = comm_per_step(param_specs(model, dedup), layout, model, dedup, tokens_per_micro_batch=8 * 256,
                            grad_accum=1, compute_bytes=4, ac_moe_layers_recomputed=recomputed)
        assert est.comm_s["all_to_all"] == pytest.approx(vol.all_to_all / 1e9 + (9 * num_moe + 6 * recomputed) * 1e-3)
