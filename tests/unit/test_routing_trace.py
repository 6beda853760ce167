"""The routing-trace recorder on a tiny stack of MoE layers, its per-rank loads and straggler factor
(worked by hand), and the report's heat map; replay through the router (R3: ids fixed, gate weights
the router's own differentiable scores); the counts the layers record equal the ids their routers
returned in training forwards (masked tokens, expert choice, forced and replayed routing, the MoE
layers checkpointed). End to end: tests/integration/test_routing_trace.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.models.moe.layer import MoELayer
from moetrain.models.moe.router import TopKRouter
from moetrain.train.report import plot_rank_load
from moetrain.train.routing_trace import Geometry, RoutingRecorder
from moetrain.train.routing_trace_read import (
    INDEX,
    TRACE_DIR,
    rank_loads,
    read_tensor,
    step_file,
    straggler_factors,
)
from moetrain.utils.safetensors_io import read_header

E, K, D = 4, 2, 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden_dim=16)) for _ in range(2)))


def _geometry(tokens: int) -> Geometry:
    return Geometry(num_experts=E, top_k=K, tokens_per_step=tokens, seq_len=tokens, micro_batch=1, local_batch=1,
                    dp_rank=0)


def test_counts_on_log_steps_only_and_not_in_eval(tmp_path, monkeypatch):
    import os

    fsyncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    model = _model()
    rec = RoutingRecorder(model, mode="counts", every=2, run_dir=tmp_path, geometry=_geometry(8), num_micro=1,
                          rank=0, world_size=1, ep=2, is_main=True, start_step=0)
    expected = {}
    for step in range(1, 5):
        x = torch.randn(8, D)
        rec.start_step(step)
        model.train()
        [layer(x) for layer in model]
        model.eval()
        [layer(x) for layer in model]  # an evaluation forward: not a training step's routing
        rec.finish_step()
        expected[step] = [torch.bincount(layer.router(x).idx_TK.reshape(-1), minlength=E) for layer in model]
    index = json.loads((tmp_path / TRACE_DIR / INDEX).read_text())
    assert index["steps"] == [2, 4] and index["layers"] == ["0", "1"]
    assert not (tmp_path / TRACE_DIR / step_file(1, 0)).exists()
    path = tmp_path / TRACE_DIR / step_file(4, 0)
    tensors, _ = read_header(path)
    for i in range(2):
        assert torch.equal(read_tensor(tensors[f"counts.{i}"], path).long(), expected[4][i])
    rec.remove()
    # A trace is a log: written atomically, never fsynced (a durable write of the same tensors is).
    assert fsyncs == []
    from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

    with ShardedWriter(tmp_path / "durable", [TensorSpec("x", (2,), torch.int32)], metadata={}) as w:
        w.write("x", torch.zeros(2, dtype=torch.int32))
        w.close()
    assert len(fsyncs) == 2  # the file and its folder


def test_rank_loads_and_straggler_factor_worked_by_hand(tmp_path):
    folder = tmp_path / TRACE_DIR
    folder.mkdir()
    from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

    # Two ranks' counts at one step, E = 4 over ep = 2: rank 0 hosts experts 0-1, rank 1 experts 2-3.
    per_rank = [torch.tensor([5, 1, 1, 1], dtype=torch.int32), torch.tensor([3, 1, 0, 0], dtype=torch.int32)]
    for rank, counts in enumerate(per_rank):
        with ShardedWriter(folder, [TensorSpec("counts.L", (E,), torch.int32)], metadata={},
                           weights=step_file(3, rank)) as w:
            w.write("counts.L", counts)
            w.close()
    (folder / INDEX).write_text(json.dumps({"format": 1, "mode": "counts", "layers": ["L"], "num_experts": E,
                                            "top_k": K, "tokens_per_step": 6, "world_size": 2, "ep": 2,
                                            "steps": [3]}))
    steps, layers, load_SLGP = rank_loads(tmp_path)
    # global counts [8, 2, 1, 1]: rank 0 gets 10 copies, rank 1 gets 2; mean 6, factor 10 / 6 (one ep group).
    assert steps == [3] and layers == ["L"] and load_SLGP.tolist() == [[[[10.0, 2.0]]]]
    assert straggler_factors(load_SLGP).tolist() == [[pytest.approx(10 / 6)]]
    made = plot_rank_load(tmp_path, tmp_path)
    assert [p.name for p in made] == ["rank_load.png", "routing_straggler.json"]
    assert json.loads(made[1].read_text())["layers"]["L"]["max"] == round(10 / 6, 5)


def test_replay_fixes_ids_and_keeps_gate_gradients():
    torch.manual_seed(0)
    router = TopKRouter(D, E, top_k=K)
    x = torch.randn(6, D)
    ids = torch.tensor([[3, 2], [0, 1], [1, 3], [2, 0], [3, 1], [0, 2]])
    router.replay_idx_TK = ids
    out = router(x)
    assert torch.equal(out.idx_TK, ids)
    probs = torch.softmax(x @ router.gate.weight.T, dim=-1)
    ref = probs.gather(1, ids)
    torch.testing.assert_close(out.weights_TK, ref / ref.sum(-1, keepdim=True))
    out.weights_TK[:, 0].sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    router.eval()  # evaluation routes by the router's own choice
    assert not torch.equal(router(x).idx_TK, ids)
    router.train()
    router.replay_idx_TK = ids[:5]
    with pytest.raises(ValueError, match="replayed ids"):
        router(x)


def test_config_rules_name_the_field():
    from moetrain.config.loader import load_config

    base = ["--moe.num_experts=4", "--moe.top_k=2"]
    for extra, field in ((["--log.routing_trace=full", "--parallel.pp=2"], "log.routing_trace"),
                         (["--moe.routing_replay=runs/x", "--parallel.pp=2"], "moe.routing_replay"),
                         (["--moe.force_skew=zipf:1", "--parallel.pp=2"], "moe.force_skew"),
                         (["--log.routing_trace=full", "--moe.router=expert_choice", "--moe.capacity_factor=1"],
                          "log.routing_trace"),
                         (["--log.routing_trace=sometimes"], "log.routing_trace")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            load_config(None, base + extra)


def test_runs_under_sequence_parallelism_worked_by_hand():
    """seq_len 8, micro-batches of 4 sequences over dp = 2 (2 per rank), tp = 2: dp rank 1, tp rank 1
    routes positions 4-7 of sequences 2 and 3 in micro 0 and of sequences 6 and 7 in micro 1; its
    tokens of both micro-batches, the tp pair's and the dp pair's cover the step once."""
    def geometry(dp_rank: int, tp_rank: int) -> Geometry:
        return Geometry(num_experts=E, top_k=K, tokens_per_step=8 * 8, seq_len=8, micro_batch=4, local_batch=2,
                        dp_rank=dp_rank, tp=2, tp_rank=tp_rank)

    assert geometry(1, 1).runs(0) == [(20, 4), (28, 4)] and geometry(1, 1).runs(1) == [(52, 4), (60, 4)]
    assert geometry(0, 0).positions(0).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    every = torch.cat([geometry(d, t).positions(m) for m in range(2) for d in range(2) for t in range(2)])
    assert sorted(every.tolist()) == list(range(64))
    one = Geometry(num_experts=E, top_k=K, tokens_per_step=64, seq_len=8, micro_batch=4, local_batch=2, dp_rank=1)
    assert one.runs(1) == [(48, 16)]


def test_forced_skew_under_tp_hands_each_rank_its_sequence_shard():
    """moe.force_skew at tp = 2: the two tp ranks' ids, put back position by position, are the ids
    one rank with whole sequences routes (the same global draw)."""
    from moetrain.train.routing_trace import ForcedSkew

    model = _model()

    def routed(tp: int, tp_rank: int) -> torch.Tensor:
        g = Geometry(num_experts=E, top_k=K, tokens_per_step=4 * 8, seq_len=8, micro_batch=4, local_batch=4,
                     dp_rank=0, tp=tp, tp_rank=tp_rank)
        skew = ForcedSkew("zipf", (1.2,), model, geometry=g)
        skew.start_step(2)
        skew.before_micro(0)
        ids = torch.stack([layer.router.replay_idx_TK for layer in model])  # [L, T_rank, K]
        skew.finish_step()
        return ids

    whole = routed(1, 0).view(2, 4, 8, K)  # [L, B, S, K]
    halves = [routed(2, r).view(2, 4, 4, K) for r in range(2)]
    assert torch.equal(torch.cat(halves, dim=2), whole)


COUNT_VARIANTS = {
    "top_k": ({}, False),
    "masked": ({}, True),  # only the real tokens are routed
    "masked_capacity": ({"capacity_factor": 1.0}, True),  # every position is routed (capacity is a share of all)
    "expert_choice": ({"router": "expert_choice", "capacity_factor": 1.0}, False),
    "round_robin": ({"force_balance": "round_robin"}, False),
    "random": ({"force_balance": "random"}, False),
    "replay": ({}, False),
}


@pytest.mark.parametrize("variant", list(COUNT_VARIANTS))
@pytest.mark.parametrize("ac", ["none", "moe"])
def test_counts_are_the_ids_each_training_forward_routed(tmp_path, variant, ac):
    # The reference is what the router returned in each training forward (not in the recompute of a
    # checkpoint, nor in evaluation), counted per expert over the step's two micro-batches: what the
    # router hook of the counts mode recorded before the layers counted it themselves.
    from moetrain.distributed.parallelize import apply_activation_checkpointing, checkpoint_blocks

    overrides, masked = COUNT_VARIANTS[variant]
    torch.manual_seed(0)
    model = nn.Sequential(*(MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden_dim=16, **overrides))
                            for _ in range(2)))
    apply_activation_checkpointing(checkpoint_blocks(model, ac), compile=False)
    rec = RoutingRecorder(model, mode="counts", every=1, run_dir=tmp_path, geometry=_geometry(8), num_micro=2,
                          rank=0, world_size=1, ep=1, is_main=True, start_step=0)
    assert all(layer.track_routing_stats and not layer.router._forward_hooks for layer in model)
    routed: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def seen(i):
        def hook(router, args, out):
            if router.training and torch._C._current_graph_task_id() == -1:
                routed[i].append(out.idx_TK.detach().reshape(-1))
        return hook

    handles = [layer.router.register_forward_hook(seen(i)) for i, layer in enumerate(model)]
    for step in (1, 2):
        routed = {0: [], 1: []}
        rec.start_step(step)
        for _ in range(2):
            x_BSD = torch.randn(2, 4, D, requires_grad=True)
            mask_BS = torch.tensor([[True, True, True, False], [True, False, False, False]]) if masked else None
            model.train()
            for layer in model:
                if variant == "replay":
                    layer.router.replay_idx_TK = torch.randint(0, E, (8, K))
                out, _ = layer(x_BSD, mask_BS) if masked else layer(x_BSD)
                out.sum().backward()
            model.eval()
            with torch.no_grad():
                [layer(x_BSD) for layer in model]  # evaluation: not counted
        rec.finish_step()
        path = tmp_path / TRACE_DIR / step_file(step, 0)
        tensors, _ = read_header(path)
        for i in range(2):
            expected = torch.bincount(torch.cat(routed[i]), minlength=E)
            assert torch.equal(read_tensor(tensors[f"counts.{i}"], path).long(), expected), (step, i)
    for h in handles:
        h.remove()
    rec.remove()
    assert not any(layer.track_routing_stats for layer in model), "the recorder turns off what it turned on"
